//! Encryption at rest in a test's config: two keys, a config that seals with them and reads every retry
//! through the store, and a keyed request executed and replayed.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{InProcessProxy, ProxyConfig, Reply, TestEnv, keyed_post, settled};

/// The tests' encryption keys, 32 bytes each.
pub const K1: [u8; 32] = [0x11; 32];
pub const K2: [u8; 32] = [0x22; 32];

/// The test config without the replay cache, so every retry is read through the store, where the sealed
/// values live.
pub fn uncached(env: &TestEnv) -> ProxyConfig {
    env.config().set("replay_cache.max_size", "0")
}

/// The test config with `[encryption]` set: `active` seals new records, `keys` may open old ones.
pub fn encrypted(env: &TestEnv, active: &str, keys: &[(&str, [u8; 32])]) -> ProxyConfig {
    let mut table = toml::Table::new();
    for (id, key) in keys {
        table.insert(id.to_string(), BASE64.encode(key).into());
    }
    uncached(env)
        .set("encryption.active_key", active)
        .set("encryption.keys", table)
}

/// Executes a keyed `POST /orders` as `key`, then retries it until the replay comes back.
pub async fn execute_and_settle(proxy: &InProcessProxy, key: &str) -> (Reply, Reply) {
    let first = Reply::of(keyed_post(&proxy.url, "/orders", key, "{\"card\":\"4111\"}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = settled(|| keyed_post(&proxy.url, "/orders", key, "{\"card\":\"4111\"}")).await;
    assert!(replay.is_replay(), "{replay:?}");
    (first, replay)
}

/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
