#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gscomm::fuzz::run("peer_buffer_entry", data));
