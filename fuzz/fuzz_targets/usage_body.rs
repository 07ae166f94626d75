#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| floodgate_fuzz::usage_body(data));
