//! Helpers shared by the crate's unit tests (compiled only for `cargo test`).

/// A small deterministic generator (splitmix64) for test data: the same seed gives the
/// same values on every platform.
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-2, 2), with a fractional part (so float sums depend on the order).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
    }
}

/// The identity of test node `id`: a key derived from the id, so every test node knows
/// every other's key without a master (`known_node`).
pub(crate) fn test_identity(id: u64) -> std::sync::Arc<crate::net::identity::Identity> {
    use crate::net::identity::{Identity, NodeKey};
    let mut seed = [7u8; 32];
    seed[..8].copy_from_slice(&id.to_be_bytes());
    Identity::new(NodeKey::from_secret(seed), None, Vec::new()).expect("no certificate")
}

/// Binds a test node made with `test_identity(cfg.peer_id)` and gives it the roster of
/// every id the tests use (what a master would hand out).
pub(crate) async fn known_node(
    mut cfg: crate::net::NodeConfig,
    addr: std::net::SocketAddr,
) -> crate::error::CoreResult<std::sync::Arc<crate::net::Node>> {
    cfg.identity = test_identity(cfg.peer_id);
    let node = crate::net::Node::bind(cfg, addr).await?;
    let roster: Vec<_> = (1..=16)
        .chain([7101, 7102, 7201, 7202, 7301, 7302])
        .map(|id| (id, *test_identity(id).key().public()))
        .collect();
    node.set_peer_keys(&roster)?;
    Ok(node)
}
