use super::*;

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A deterministic, sign-mixed tensor without ties.
fn sample(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i as u64 * 2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5;
            x * (1.0 + (i % 7) as f32)
        })
        .collect()
}

fn encode(p: &Params, v: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut acc = bytes(v);
    let mut out = vec![0u8; encoded_len(p)];
    compress(p, &mut acc, &mut out).unwrap();
    (out, floats(&acc))
}

#[test]
fn the_residual_is_exactly_what_the_payload_does_not_carry() {
    for &(count, chunk, k, bits) in &[(1000, 64, 2, 2), (1000, 64, 1, 4), (77, 16, 3, 8)] {
        let p = Params::new(count, chunk, k, bits).unwrap();
        let v = sample(count);
        let (payload, residual) = encode(&p, &v);
        assert_eq!(payload.len(), encoded_len(&p));
        let mut decoded = vec![0u8; 4 * count];
        decode_add(&p, &payload, &mut decoded).unwrap();
        let decoded = floats(&decoded);
        for i in 0..count {
            assert_eq!(residual[i].to_bits(), (v[i] - decoded[i]).to_bits(), "{i}");
        }
        // Exactly min(k, len) elements per chunk are carried, the largest magnitudes.
        for (c, part) in v.chunks(chunk).enumerate() {
            let carried: Vec<usize> = (0..part.len())
                .filter(|&o| decoded[c * chunk + o] != 0.0 || residual[c * chunk + o] != part[o])
                .collect();
            assert_eq!(carried.len(), k.min(part.len()));
            let least_kept = carried
                .iter()
                .map(|&o| part[o].abs())
                .fold(f32::MAX, f32::min);
            for o in (0..part.len()).filter(|o| !carried.contains(o)) {
                assert!(part[o].abs() <= least_kept);
                assert_eq!(residual[c * chunk + o].to_bits(), part[o].to_bits());
            }
        }
    }
}

#[test]
fn two_bits_decode_to_four_levels_of_the_largest_kept_magnitude() {
    let p = Params::new(8, 4, 4, 2).unwrap();
    let v = [3.0, -3.0, 1.1, -0.9, 0.0, 2.0, -1.0, 0.1];
    let (payload, _) = encode(&p, &v);
    let mut out = vec![0u8; 32];
    decode_add(&p, &payload, &mut out).unwrap();
    // Levels -3, -1, 1, 3; 0.0 and 0.1 round to 1 (2 bits have no zero), 2.0 to 3.
    let want = [3.0, -3.0, 1.0, -1.0, 1.0, 3.0, -1.0, 1.0];
    let got = floats(&out);
    for i in 0..8 {
        assert!(
            (got[i] - want[i]).abs() < 1e-6,
            "{i}: {} vs {}",
            got[i],
            want[i]
        );
    }
}

#[test]
fn the_same_input_gives_the_same_payload_and_ties_keep_the_lower_offset() {
    let p = Params::new(64, 8, 2, 4).unwrap();
    let v = vec![1.0f32; 64]; // all tied: offsets 0 and 1 of every chunk
    let (a, _) = encode(&p, &v);
    let (b, residual) = encode(&p, &v);
    assert_eq!(a, b);
    for c in 0..8 {
        assert_eq!(residual[c * 8], 0.0);
        assert_eq!(residual[c * 8 + 1], 0.0);
        assert!(residual[c * 8 + 2..c * 8 + 8].iter().all(|&x| x == 1.0));
    }
}

#[test]
fn sizes_are_what_the_wire_format_says() {
    // 1,000,000 elements, chunk 64, k 1, 2 bits: 15,625 entries of 6 + 2 bits.
    let p = Params::new(1_000_000, 64, 1, 2).unwrap();
    assert_eq!(p.index_bits(), 6);
    assert_eq!(encoded_len(&p), HEADER_LEN + 15_625);
    // A short last chunk keeps min(k, len).
    let p = Params::new(10, 8, 3, 8).unwrap();
    assert_eq!(p.entries(), 3 + 2);
    assert_eq!(Params::new(5, 2, 1, 2).unwrap().index_bits(), 1);
    assert_eq!(Params::new(5, 3, 1, 2).unwrap().index_bits(), 2);
}

#[test]
fn bad_parameters_are_refused() {
    assert!(Params::new(10, 1, 1, 2).is_err());
    assert!(Params::new(10, 8, 0, 2).is_err());
    assert!(Params::new(10, 8, 9, 2).is_err());
    assert!(Params::new(10, 8, 2, 3).is_err());
    let p = Params::new(4, 2, 1, 2).unwrap();
    let mut acc = bytes(&[1.0, f32::NAN, 0.0, 0.0]);
    let mut out = vec![0u8; encoded_len(&p)];
    assert!(matches!(
        compress(&p, &mut acc, &mut out),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn a_hostile_payload_is_refused_and_changes_nothing() {
    let p = Params::new(100, 16, 2, 2).unwrap();
    let (good, _) = encode(&p, &sample(100));
    let before = bytes(&sample(100));
    let check = |payload: &[u8], params: &Params| {
        let mut dst = before.clone();
        let r = decode_add(params, payload, &mut dst);
        assert!(matches!(r, Err(CoreError::Protocol(_))), "{r:?}");
        assert_eq!(dst, before);
    };
    check(&good[..good.len() - 1], &p); // short
    let mut long = good.clone();
    long.push(0);
    check(&long, &p);
    let mut magic = good.clone();
    magic[0] ^= 1;
    check(&magic, &p);
    check(&good, &Params::new(100, 16, 2, 4).unwrap_or(p)); // other bits: other length
    let mut k = good.clone();
    k[10] = 3;
    check(&k, &p);
    for scale in [f32::NAN, f32::INFINITY, -1.0, -0.0] {
        let mut s = good.clone();
        s[12..16].copy_from_slice(&scale.to_le_bytes());
        check(&s, &p);
    }
    // Forged bodies: a control that passes, then a repeated offset, an offset past the
    // short last chunk (20 = 16 + 4), and a set padding bit.
    let p2 = Params::new(20, 16, 2, 2).unwrap();
    let mut dst = vec![0u8; 80];
    decode_add(
        &p2,
        &forge(&p2, 1.0, &[(5, 1), (6, 1), (0, 0), (3, 0)]),
        &mut dst,
    )
    .unwrap();
    for entries in [
        [(5, 1), (5, 1), (0, 0), (1, 0)],
        [(5, 1), (6, 1), (0, 0), (4, 0)],
    ] {
        let before = dst.clone();
        assert!(decode_add(&p2, &forge(&p2, 1.0, &entries), &mut dst).is_err());
        assert_eq!(dst, before);
    }
    let mut pad = forge(&p2, 1.0, &[(5, 1), (6, 1), (0, 0), (3, 0)]);
    *pad.last_mut().unwrap() |= 0x80; // 4 entries of 6 bits: the last byte is full
    assert!(decode_add(&p2, &pad, &mut dst).is_ok());
    let p3 = Params::new(20, 16, 1, 2).unwrap(); // 2 entries of 6 bits: 4 padding bits
    let mut pad = forge(&p3, 1.0, &[(5, 1), (0, 0)]);
    decode_add(&p3, &pad, &mut dst).unwrap();
    *pad.last_mut().unwrap() |= 0x80;
    assert!(decode_add(&p3, &pad, &mut dst).is_err());
}

fn forge(p: &Params, scale: f32, entries: &[(u32, u32)]) -> Vec<u8> {
    let mut out = vec![0u8; encoded_len(p)];
    out[..4].copy_from_slice(&MAGIC);
    out[4..8].copy_from_slice(&(p.count as u32).to_le_bytes());
    out[8..10].copy_from_slice(&(p.chunk as u16).to_le_bytes());
    out[10] = p.k as u8;
    out[11] = p.bits as u8;
    out[12..16].copy_from_slice(&scale.to_le_bytes());
    let mut w = BitWriter {
        out: &mut out[HEADER_LEN..],
        pos: 0,
        acc: 0,
        n: 0,
    };
    for &(offset, code) in entries {
        w.put(offset, p.index_bits());
        w.put(code, p.bits);
    }
    assert_eq!(w.finish(), encoded_len(p) - HEADER_LEN);
    out
}

#[test]
fn payloads_summed_in_rank_order_give_the_same_bytes_anywhere() {
    let p = Params::new(300, 32, 2, 2).unwrap();
    let payloads: Vec<Vec<u8>> = (0..4)
        .map(|r| {
            let v: Vec<f32> = sample(300).iter().map(|x| x * (r as f32 + 1.0)).collect();
            encode(&p, &v).0
        })
        .collect();
    let sum = || {
        let mut dst = vec![0u8; 1200];
        for pl in &payloads {
            decode_add(&p, pl, &mut dst).unwrap();
        }
        dst
    };
    assert_eq!(sum(), sum());
}

/// The encoder as first written (a full sort-based selection per chunk and the scale
/// taken over the kept values): what `compress` must still produce, byte for byte.
fn reference_compress(p: &Params, v: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut kept = Vec::new();
    for (c, chunk) in v.chunks(p.chunk).enumerate() {
        let mut order: Vec<usize> = (0..chunk.len()).collect();
        order.sort_by(|&a, &b| chunk[b].abs().total_cmp(&chunk[a].abs()).then(a.cmp(&b)));
        order.truncate(p.k);
        order.sort_unstable();
        kept.extend(order.iter().map(|&o| c * p.chunk + o));
    }
    let scale = kept.iter().fold(0.0f32, |m, &i| m.max(v[i].abs()));
    let mut out = vec![0u8; encoded_len(p)];
    out[..4].copy_from_slice(&MAGIC);
    out[4..8].copy_from_slice(&(p.count as u32).to_le_bytes());
    out[8..10].copy_from_slice(&(p.chunk as u16).to_le_bytes());
    out[10] = p.k as u8;
    out[11] = p.bits as u8;
    out[12..16].copy_from_slice(&scale.to_le_bytes());
    let mut residual = v.to_vec();
    let mut w = BitWriter {
        out: &mut out[HEADER_LEN..],
        pos: 0,
        acc: 0,
        n: 0,
    };
    for &i in &kept {
        let code = quantize(p, scale, v[i]);
        w.put((i % p.chunk) as u32, p.index_bits());
        w.put(code, p.bits);
        residual[i] = v[i] - level_value(p, scale, code);
    }
    w.finish();
    (out, residual)
}

#[test]
fn the_fast_selections_give_the_reference_encoders_bytes() {
    let mut rng = crate::testutil::SplitMix(17);
    // (chunk, k): k = 1, small k (one pass), large k (select_nth), k >= a short chunk.
    let shapes = [
        (64, 1),
        (64, 2),
        (3, 2),
        (5, 2),
        (64, 16),
        (128, 17),
        (64, 40),
        (7, 3),
        (2, 2),
        (300, 255),
    ];
    for (case, &(chunk, k)) in shapes.iter().enumerate() {
        for bits in [2, 4, 8] {
            for count in [chunk * 5 + chunk / 2 + 1, chunk, 1] {
                let Ok(p) = Params::new(count, chunk, k, bits) else {
                    continue;
                };
                // Few distinct magnitudes, both signs, zeros: many ties to break.
                let v: Vec<f32> = (0..count)
                    .map(|_| {
                        let q = (rng.next() % 9) as f32 - 4.0;
                        if rng.next().is_multiple_of(5) {
                            q * 0.25
                        } else {
                            q
                        }
                    })
                    .collect();
                let (got, got_res) = encode(&p, &v);
                let (want, want_res) = reference_compress(&p, &v);
                assert_eq!(
                    got, want,
                    "case {case}: chunk {chunk} k {k} bits {bits} n {count}"
                );
                assert_eq!(bytes(&got_res), bytes(&want_res), "case {case}: residuals");
            }
        }
    }
}
