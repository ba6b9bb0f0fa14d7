"""Mints the keys, key sets and tokens tests/it/keys/jwt.rs sends through the proxy, with PyJWT.

Usage: mint.py ISSUER AUDIENCE. Prints one JSON object: "jwks_1" (keys rsa-1 and ec-1), "jwks_2" (the
same and rsa-2, after a rotation), "jwks_dup" (rsa-1 and rsa-2 both under kid "dup", as a set may hold
two keys under one kid while one rotates out), and "tokens", each a compact JWT named for what it is.
"""

import base64
import hashlib
import hmac
import json
import sys
import time
import uuid

import jwt
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm


def jwk(public_key, algorithm, kid, alg):
    key = json.loads(algorithm.to_jwk(public_key))
    key.update({"kid": kid, "use": "sig", "alg": alg})
    return key


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def main():
    issuer, audience = sys.argv[1], sys.argv[2]
    rsa_1 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_1 = ec.generate_private_key(ec.SECP256R1())
    ed_1 = ed25519.Ed25519PrivateKey.generate()
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    set_1 = [
        jwk(rsa_1.public_key(), RSAAlgorithm, "rsa-1", "RS256"),
        jwk(ec_1.public_key(), ECAlgorithm, "ec-1", "ES256"),
        jwk(ed_1.public_key(), OKPAlgorithm, "ed-1", "EdDSA"),
    ]
    set_2 = set_1 + [jwk(rsa_2.public_key(), RSAAlgorithm, "rsa-2", "PS256")]
    set_dup = [
        jwk(rsa_1.public_key(), RSAAlgorithm, "dup", "RS256"),
        jwk(rsa_2.public_key(), RSAAlgorithm, "dup", "RS256"),
    ]

    now = int(time.time())

    def claims(sub, **changes):
        body = {"iss": issuer, "aud": audience, "sub": sub, "iat": now, "exp": now + 600,
                "jti": str(uuid.uuid4())}
        body.update(changes)
        return {k: v for k, v in body.items() if v is not None}

    def sign(key, alg, kid, body):
        return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})

    public_pem = rsa_1.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    unsigned = b64(json.dumps({"alg": "none", "typ": "JWT", "kid": "rsa-1"}).encode()) + "." + \
        b64(json.dumps(claims("alice")).encode())
    hmac_input = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode()) + "." + \
        b64(json.dumps(claims("alice")).encode())
    hmac_signature = b64(hmac.new(public_pem, hmac_input.encode(), hashlib.sha256).digest())

    def rs256_raw(header, payload):
        """Signed by rsa-1 over the JSON given as text: headers and claims PyJWT would not write."""
        signing_input = b64(header.encode()) + "." + b64(payload.encode())
        signature = rsa_1.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return signing_input + "." + b64(signature)

    def claims_text(**changes):
        return json.dumps(claims("alice", **changes))

    tokens = {
        "alice": sign(rsa_1, "RS256", "rsa-1", claims("alice")),
        # The same subject after a refresh: issued later, another jti, another expiry.
        "alice_refreshed": sign(rsa_1, "RS256", "rsa-1", claims("alice", iat=now + 1, exp=now + 900)),
        "alice_ec": sign(ec_1, "ES256", "ec-1", claims("alice", iat=now + 2)),
        "alice_eddsa": sign(ed_1, "EdDSA", "ed-1", claims("alice", iat=now + 3)),
        "alice_no_kid": jwt.encode(claims("alice", iat=now + 4), rsa_1, algorithm="RS256"),
        "bob": sign(rsa_1, "RS256", "rsa-1", claims("bob")),
        "alice_rotated": sign(rsa_2, "PS256", "rsa-2", claims("alice", iat=now + 5)),
        # Valid for ten seconds: taken now, refused soon (a verified token is not taken past its exp).
        "alice_short": sign(rsa_1, "RS256", "rsa-1", claims("alice", iat=now + 6, exp=now + 10)),
        "forged": sign(stranger, "RS256", "rsa-1", claims("alice")),
        "expired": sign(rsa_1, "RS256", "rsa-1", claims("alice", iat=now - 7200, exp=now - 3600)),
        "not_yet": sign(rsa_1, "RS256", "rsa-1", claims("alice", nbf=now + 3600)),
        "other_audience": sign(rsa_1, "RS256", "rsa-1", claims("alice", aud="someone-else")),
        "other_issuer": sign(rsa_1, "RS256", "rsa-1", claims("alice", iss="https://evil.example/")),
        "no_subject": sign(rsa_1, "RS256", "rsa-1", claims(None)),
        "no_expiry": sign(rsa_1, "RS256", "rsa-1", claims("alice", exp=None)),
        "unknown_kid": sign(stranger, "RS256", "ghost", claims("alice")),
        "alg_none": unsigned + ".",
        "hmac_with_public_key": hmac_input + "." + hmac_signature,
        # Signed by the issuer's key, but refused by a recipient as RFC 7515 and 7519 ask (and PyJWT
        # does): an extension named critical, an issuer that is not a string, a not-before time that
        # is not a number.
        "critical_extension": rs256_raw(
            '{"alg":"RS256","typ":"JWT","kid":"rsa-1","crit":["https://issuer.test/ext"],'
            '"https://issuer.test/ext":true}',
            claims_text(),
        ),
        "issuer_array": rs256_raw(
            '{"alg":"RS256","typ":"JWT","kid":"rsa-1"}',
            claims_text(iss=[issuer, "https://evil.example/"]),
        ),
        "nbf_text": rs256_raw('{"alg":"RS256","typ":"JWT","kid":"rsa-1"}', claims_text(nbf="tomorrow")),
        # A subject past 64 bits: read as a float, it would be one client with its neighbours.
        "subject_past_64_bits": sign(rsa_1, "RS256", "rsa-1", claims(123456789012345678901234567890)),
        # A subject named twice: which one the app reads is its JSON parser's choice.
        "subject_named_twice": rs256_raw(
            '{"alg":"RS256","typ":"JWT","kid":"rsa-1"}',
            claims_text()[:-1] + ', "sub": "bob"}',
        ),
        # A subject that names no one: every such token would be one client.
        "empty_subject": sign(rsa_1, "RS256", "rsa-1", claims("")),
        # Both keys of jwks_dup carry kid "dup".
        "alice_dup_first": sign(rsa_1, "RS256", "dup", claims("alice", iat=now + 6)),
        "alice_dup_second": sign(rsa_2, "RS256", "dup", claims("alice", iat=now + 7)),
    }
    print(json.dumps({
        "jwks_1": {"keys": set_1},
        "jwks_2": {"keys": set_2},
        "jwks_dup": {"keys": set_dup},
        "tokens": tokens,
    }))


if __name__ == "__main__":
    main()
