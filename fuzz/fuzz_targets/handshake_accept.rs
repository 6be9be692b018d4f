#![no_main]
//! See `_core::fuzzing::handshake_accept` for the input layout and the invariants checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::handshake_accept(data));
