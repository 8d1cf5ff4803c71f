#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gscomm::fuzz::run("coll_signature", data));
