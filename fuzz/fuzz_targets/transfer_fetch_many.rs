#![no_main]
//! See `_core::fuzzing::transfer_fetch_many` for the input layout and the invariants checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::transfer_fetch_many(data));
