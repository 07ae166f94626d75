#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| floodgate_fuzz::inflight_record(data));
