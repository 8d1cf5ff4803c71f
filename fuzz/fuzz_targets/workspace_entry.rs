#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gscomm::fuzz::run("workspace_entry", data));
