//! Webhook deliveries signed as their senders sign them (Standard Webhooks, Stripe, GitHub, Shopify, a
//! generic HMAC), at the current time, and the secrets files a route reads its secrets from.

use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};

/// The Stripe secret the tests sign with (`stripe_signature` reproduces Stripe's vector with it).
pub const STRIPE_SECRET: &str = "whsec_test_secret";

/// A temporary secrets file holding `lines`, one secret a line, removed on drop.
pub fn secrets_file(lines: &[&str]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("a secrets file");
    for line in lines {
        writeln!(file, "{line}").expect("secrets written");
    }
    file
}

/// A `[[routes]]` table for Stripe's webhooks at `/webhooks/stripe`, keyed by the event's `id`, its
/// secrets read from `secrets`.
pub fn stripe_route(secrets: &std::path::Path) -> String {
    format!(
        r#"
[[routes]]
name = "stripe"
path = "/webhooks/stripe"
key = "json:/id"
required = true
unscoped = "shared"
scope_headers = []
signature = {{ scheme = "stripe", secrets_file = "{}" }}
"#,
        secrets.display()
    )
}

/// Seconds since 1970, as a sender stamps a delivery.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<sha2_11::Sha256>::new_from_slice(key).expect("any key length");
    parts.iter().for_each(|part| mac.update(part));
    mac.finalize().into_bytes().to_vec()
}

/// `webhook-signature` as a Standard Webhooks sender writes it: `v1,` and the base64 HMAC of
/// `id.timestamp.body` under the secret's base64 part.
pub fn sw_signature(secret: &str, id: &str, timestamp: u64, body: &str) -> String {
    let key = BASE64
        .decode(secret.trim_start_matches("whsec_"))
        .expect("a base64 secret");
    let signed = format!("{id}.{timestamp}.{body}");
    format!("v1,{}", BASE64.encode(hmac_sha256(&key, &[signed.as_bytes()])))
}

/// `Stripe-Signature` as Stripe writes it: `t=` and `v1=` the hex HMAC of `t.body` under the whole secret.
pub fn stripe_signature(secret: &str, t: u64, body: &str) -> String {
    let mac = hmac_sha256(secret.as_bytes(), &[format!("{t}.").as_bytes(), body.as_bytes()]);
    format!("t={t},v1={}", hex::encode(mac))
}

pub fn github_signature(secret: &str, body: &str) -> String {
    format!(
        "sha256={}",
        hex::encode(hmac_sha256(secret.as_bytes(), &[body.as_bytes()]))
    )
}

pub fn shopify_signature(secret: &str, body: &str) -> String {
    BASE64.encode(hmac_sha256(secret.as_bytes(), &[body.as_bytes()]))
}

pub fn generic_signature(secret: &str, body: &str) -> String {
    let mut mac = Hmac::<sha2_11::Sha512>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(body.as_bytes());
    BASE64.encode(mac.finalize().into_bytes())
}
