#![no_main]
//! See `_core::fuzzing::probe` for the input layout and the invariants checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::probe(data));
