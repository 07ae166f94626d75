#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| floodgate_fuzz::watchdog_record(data));
