//! Runs while a keyed request is fingerprinted, on every route, when its `Content-Type` is
//! `multipart/form-data`: a digest of the form's parts (each part's headers and bytes, in order) without
//! the boundary, which every client draws at random for each request, so an upload retried with a new
//! boundary still matches and one with another file, filename, field name, part type or order does not.
//! Read in place over the body, which is whole in memory: the delimiters are found with `memchr`'s
//! `memmem` and each part's headers read by `httparse` (hyper's, both already in the tree); nothing is
//! allocated (a fixed array of [`MAX_PART_HEADERS`] on the stack), so there is nothing to charge to the
//! body budget. A body that is not a form under its declared boundary, or holds more than [`MAX_PARTS`]
//! parts or a part head over [`MAX_PART_HEAD`] bytes, has no digest and counts byte for byte. Pure
//! functions of the head and the body.

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use memchr::memmem;
use sha2::{Digest, Sha256};

/// The most parts a form may hold and still be read by its parts: 1,000, PHP's `max_input_vars`.
pub const MAX_PARTS: usize = 1000;

/// The most bytes a part's headers may take, their blank line included.
pub const MAX_PART_HEAD: usize = 8 * 1024;

/// The most header lines a part may carry.
pub const MAX_PART_HEADERS: usize = 32;

/// The longest boundary RFC 2046 allows.
const MAX_BOUNDARY: usize = 70;

/// A `multipart/form-data` request's `Content-Type`: the value, where its boundary parameter is, and
/// the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Form<'h> {
    value: &'h [u8],
    /// The boundary parameter with the `;` before it: what the head's hash leaves out.
    cut: (usize, usize),
    boundary: &'h [u8],
}

impl<'h> Form<'h> {
    /// The form `headers` declare: one `Content-Type` of type `multipart/form-data` with one valid
    /// `boundary` parameter and none in RFC 2231's forms (`boundary*`); `None` otherwise.
    pub fn of(headers: &'h HeaderMap) -> Option<Form<'h>> {
        let mut values = headers.get_all(CONTENT_TYPE).iter();
        let value = values.next()?.as_bytes();
        if values.next().is_some() {
            return None;
        }
        Form::parse(value)
    }

    fn parse(value: &'h [u8]) -> Option<Form<'h>> {
        let essence_end = memchr::memchr(b';', value).unwrap_or(value.len());
        if !value[..essence_end]
            .trim_ascii()
            .eq_ignore_ascii_case(b"multipart/form-data")
        {
            return None;
        }
        let mut found = None;
        for param in Params::new(value, essence_end) {
            let param = param?;
            // `boundary*=utf-8''x` or `boundary*0=x` (RFC 2231) name the boundary too, and Werkzeug and
            // Go's `mime` let them win over `boundary`: the form the app reads is not this one.
            if is_extended_boundary(param.name) {
                return None;
            }
            if param.name.eq_ignore_ascii_case(b"boundary") {
                if found.is_some() {
                    return None;
                }
                found = Some((param.start, param.end, param.value));
            }
        }
        let (start, end, boundary) = found?;
        is_boundary(boundary).then_some(Form {
            value,
            cut: (start, end),
            boundary,
        })
    }

    /// The `Content-Type` value without its boundary parameter, in two pieces: what the head's hash
    /// counts when the body is read as this form.
    pub fn without_boundary(&self) -> [&'h [u8]; 2] {
        [&self.value[..self.cut.0], &self.value[self.cut.1..]]
    }

    /// The digest of `body`'s parts under this form's boundary; `None` when the body is not such a
    /// form, or is over the limits.
    pub fn digest(&self, body: &[u8]) -> Option<[u8; 32]> {
        let mut delimiter = [0u8; MAX_BOUNDARY + 4];
        let len = self.boundary.len() + 4;
        delimiter[..4].copy_from_slice(b"\r\n--");
        delimiter[4..len].copy_from_slice(self.boundary);
        let delimiter = &delimiter[..len];
        let mut hash = Sha256::new();
        walk(body, delimiter, &memmem::Finder::new(delimiter), &mut hash)?;
        Some(hash.finalize().into())
    }
}

/// Whether `name` is the boundary parameter in RFC 2231's extended or continued form (`boundary*`,
/// `boundary*0`, `boundary*0*`), in any case.
fn is_extended_boundary(name: &[u8]) -> bool {
    name.len() > b"boundary".len()
        && name[..b"boundary".len()].eq_ignore_ascii_case(b"boundary")
        && name[b"boundary".len()] == b'*'
}

/// Whether `b` is a boundary RFC 2046 allows: 1 to 70 of its characters, not ending with a space.
fn is_boundary(b: &[u8]) -> bool {
    let allowed = |c: &u8| c.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(c);
    (1..=MAX_BOUNDARY).contains(&b.len()) && b.iter().all(allowed) && !b.ends_with(b" ")
}

/// One `;`-separated parameter of a media type: its span (from the `;`), name and value (unquoted).
struct Param<'h> {
    start: usize,
    end: usize,
    name: &'h [u8],
    value: &'h [u8],
}

/// The parameters after a media type's essence (RFC 9110 §5.6.6): `OWS ";" OWS token "=" (token /
/// quoted-string)`. Each is `None` when it is not of that form; a quoted value with an escape is not
/// read (no boundary holds one).
struct Params<'h> {
    value: &'h [u8],
    at: usize,
}

impl<'h> Params<'h> {
    fn new(value: &'h [u8], at: usize) -> Params<'h> {
        Params { value, at }
    }

    fn param(&mut self) -> Option<Param<'h>> {
        let v = self.value;
        let start = self.at;
        let mut i = start + 1;
        i += skip_ows(&v[i..]);
        let name_start = i;
        i += v[i..].iter().take_while(|c| is_tchar(**c)).count();
        let name = &v[name_start..i];
        if name.is_empty() || v.get(i) != Some(&b'=') {
            return None;
        }
        i += 1;
        let value = if v.get(i) == Some(&b'"') {
            let close = i + 1 + memchr::memchr2(b'"', b'\\', &v[i + 1..])?;
            if v[close] != b'"' {
                return None;
            }
            let quoted = &v[i + 1..close];
            i = close + 1;
            quoted
        } else {
            let token_start = i;
            i += v[i..].iter().take_while(|c| is_tchar(**c)).count();
            &v[token_start..i]
        };
        let end = i;
        i += skip_ows(&v[i..]);
        if i < v.len() && v[i] != b';' {
            return None;
        }
        self.at = i;
        Some(Param {
            start,
            end,
            name,
            value,
        })
    }
}

impl<'h> Iterator for Params<'h> {
    type Item = Option<Param<'h>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.value.len() {
            return None;
        }
        let param = self.param();
        if param.is_none() {
            self.at = self.value.len();
        }
        Some(param)
    }
}

fn skip_ows(bytes: &[u8]) -> usize {
    bytes.iter().take_while(|c| matches!(c, b' ' | b'\t')).count()
}

/// A token character (RFC 9110 §5.6.2).
fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

/// Tags that frame the digest: a part (its headers, then its content) follows, or the epilogue (the
/// end).
const PART: u8 = b'P';
const END: u8 = b'E';

/// Reads the form: preamble, parts, epilogue, each framed, into `hash`. `delimiter` is `CRLF--boundary`.
fn walk(body: &[u8], delimiter: &[u8], finder: &memmem::Finder<'_>, hash: &mut Sha256) -> Option<()> {
    // The first delimiter may open the body, without the line break before it.
    let first = if body.starts_with(&delimiter[2..]) {
        0
    } else {
        finder.find(body)? + 2
    };
    field(hash, b"multipart/form-data");
    field(hash, &body[..first]);
    let mut rest = &body[first + delimiter.len() - 2..];
    let mut parts = 0usize;
    while let Some(after) = rest.strip_prefix(b"\r\n") {
        parts += 1;
        if parts > MAX_PARTS {
            return None;
        }
        let content = part_head(after, hash)?;
        let end = finder.find(&after[content..])? + content;
        field(hash, &after[content..end]);
        rest = &after[end + delimiter.len()..];
    }
    let epilogue = rest.strip_prefix(b"--").filter(|_| parts > 0)?;
    hash.update([END]);
    field(hash, epilogue);
    Some(())
}

/// Hashes a part's headers (a count, then each name in lower case and value without surrounding
/// whitespace, in order) and returns where its content begins.
fn part_head(part: &[u8], hash: &mut Sha256) -> Option<usize> {
    let window = &part[..part.len().min(MAX_PART_HEAD)];
    let mut headers = [httparse::EMPTY_HEADER; MAX_PART_HEADERS];
    let (len, headers) = match httparse::parse_headers(window, &mut headers) {
        Ok(httparse::Status::Complete(done)) => done,
        _ => return None,
    };
    // Lines end with CRLF only: a bare LF is a spelling other parsers read otherwise.
    let head = &part[..len];
    if memchr::memchr_iter(b'\n', head).any(|at| at == 0 || head[at - 1] != b'\r') {
        return None;
    }
    hash.update([PART]);
    count(hash, headers.len());
    for header in headers.iter() {
        count(hash, header.name.len());
        for chunk in header.name.as_bytes().chunks(64) {
            let mut lower = [0u8; 64];
            lower[..chunk.len()].copy_from_slice(chunk);
            lower.make_ascii_lowercase();
            hash.update(&lower[..chunk.len()]);
        }
        field(hash, header.value.trim_ascii());
    }
    Some(len)
}

fn field(hash: &mut Sha256, bytes: &[u8]) {
    count(hash, bytes.len());
    hash.update(bytes);
}

fn count(hash: &mut Sha256, n: usize) {
    hash.update((n as u64).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Method, Uri};

    use super::*;
    use crate::config::{FingerprintBody, KeyRules, RawIdempotency};
    use crate::proxy::key::{fingerprint, json::Scratch};

    /// A part: its headers (as written), then its content.
    type Part<'a> = (&'a [&'a str], &'a [u8]);

    /// A form body as a client writes it under `boundary`.
    fn form(boundary: &str, parts: &[Part<'_>]) -> Vec<u8> {
        let mut body = Vec::new();
        for (headers, content) in parts {
            body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
            for header in *headers {
                body.extend_from_slice(format!("{header}\r\n").as_bytes());
            }
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(content);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        body
    }

    /// A file field and a text field, as httpx sends them.
    fn upload<'a>(file: &'a [u8], filename: &str, field: &str, kind: &str) -> Vec<(Vec<String>, &'a [u8])> {
        vec![
            (
                vec![format!(r#"Content-Disposition: form-data; name="note""#)],
                &b"first upload"[..],
            ),
            (
                vec![
                    format!(r#"Content-Disposition: form-data; name="{field}"; filename="{filename}""#),
                    format!("Content-Type: {kind}"),
                ],
                file,
            ),
        ]
    }

    fn body_of(boundary: &str, parts: &[(Vec<String>, &[u8])]) -> Vec<u8> {
        let headers: Vec<Vec<&str>> = parts
            .iter()
            .map(|(h, _)| h.iter().map(String::as_str).collect())
            .collect();
        let parts: Vec<Part<'_>> = parts
            .iter()
            .zip(&headers)
            .map(|((_, content), h)| (h.as_slice(), *content))
            .collect();
        form(boundary, &parts)
    }

    fn policy(body: FingerprintBody) -> KeyRules {
        RawIdempotency {
            fingerprint_body: body,
            ..RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key
    }

    fn fp_with(policy: &KeyRules, content_type: &str, body: &[u8]) -> [u8; 32] {
        let uri: Uri = "/upload".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        let mut scratch = Scratch::unbounded();
        fingerprint(policy, &Method::POST, &uri, &headers, body, &mut scratch).unwrap()
    }

    fn fp(boundary: &str, body: &[u8]) -> [u8; 32] {
        let content_type = format!("multipart/form-data; boundary={boundary}");
        fp_with(&policy(FingerprintBody::Bytes), &content_type, body)
    }

    fn digest(boundary: &str, body: &[u8]) -> Option<[u8; 32]> {
        let value = format!("multipart/form-data; boundary=\"{boundary}\"");
        Form::parse(value.as_bytes()).unwrap().digest(body)
    }

    const PDF: &[u8] = b"%PDF-1.7\r\n--not-the-boundary\r\n\x00\xff binary";

    #[test]
    fn a_retry_with_a_new_boundary_is_the_same_request() {
        let parts = upload(PDF, "invoice.pdf", "file", "application/pdf");
        let first = fp("a1b2c3", &body_of("a1b2c3", &parts));
        let retry = fp("----x9y8z7", &body_of("----x9y8z7", &parts));
        assert_eq!(first, retry);
        for policy in [policy(FingerprintBody::Json), policy(FingerprintBody::Bytes)] {
            assert_eq!(
                fp_with(
                    &policy,
                    "multipart/form-data; boundary=a1b2c3",
                    &body_of("a1b2c3", &parts)
                ),
                fp_with(
                    &policy,
                    "multipart/form-data; boundary=\"zz\"",
                    &body_of("zz", &parts)
                ),
                "whatever fingerprint_body says, the boundary quoted or not"
            );
        }
    }

    #[test]
    fn every_part_of_the_form_counts() {
        let base = fp(
            "b",
            &body_of("b", &upload(PDF, "invoice.pdf", "file", "application/pdf")),
        );
        let other = |parts: &[(Vec<String>, &[u8])]| fp("c", &body_of("c", parts));
        let cases = [
            (
                "another file",
                upload(b"%PDF-1.7 other", "invoice.pdf", "file", "application/pdf"),
            ),
            (
                "another filename",
                upload(PDF, "invoice2.pdf", "file", "application/pdf"),
            ),
            (
                "another field name",
                upload(PDF, "invoice.pdf", "document", "application/pdf"),
            ),
            (
                "another part type",
                upload(PDF, "invoice.pdf", "file", "application/octet-stream"),
            ),
        ];
        for (why, parts) in &cases {
            assert_ne!(base, other(parts), "{why}");
        }
        let mut swapped = upload(PDF, "invoice.pdf", "file", "application/pdf");
        swapped.reverse();
        assert_ne!(base, other(&swapped), "parts in another order");
    }

    #[test]
    fn a_value_never_passes_from_one_field_to_another() {
        let field = |name: &str| vec![format!(r#"Content-Disposition: form-data; name="{name}""#)];
        let a_then_b = body_of("b", &[(field("a"), b"1"), (field("b"), b"2")]);
        let moved = body_of("b", &[(field("a"), b"12"), (field("b"), b"")]);
        let renamed = body_of("b", &[(field("b"), b"1"), (field("a"), b"2")]);
        let one = fp("b", &a_then_b);
        assert_ne!(one, fp("b", &moved), "content moved from one field to another");
        assert_ne!(one, fp("b", &renamed), "values moved between the names");
        let no_headers = form("b", &[(&[], b"Content-Disposition: x\r\n\r\n1")]);
        let with_header = form("b", &[(&["Content-Disposition: x"], b"1")]);
        assert_ne!(
            fp("b", &no_headers),
            fp("b", &with_header),
            "headers apart from content"
        );
        let preamble = [&b"pre\r\n"[..], &a_then_b].concat();
        assert_ne!(one, fp("b", &preamble), "a preamble counts");
        let epilogue = [&a_then_b[..], b"post"].concat();
        assert_ne!(one, fp("b", &epilogue), "an epilogue counts");
    }

    #[test]
    fn part_headers_count_by_their_meaning_not_their_spelling() {
        let spelt = |cd: &str| form("b", &[(&[cd, "Content-Type: text/plain"], b"x")]);
        let plain = fp("b", &spelt(r#"Content-Disposition: form-data; name="a""#));
        assert_eq!(
            plain,
            fp("b", &spelt(r#"content-disposition:   form-data; name="a"  "#))
        );
        assert_ne!(
            plain,
            fp("b", &spelt(r#"Content-Disposition: form-data; name="A""#))
        );
        let utf8 = "Content-Disposition: form-data; name=\"f\"; filename=\"résumé.pdf\"";
        let other = "Content-Disposition: form-data; name=\"f\"; filename=\"resume.pdf\"";
        let raw = |cd: &str| form("b", &[(&[cd], b"x")]);
        assert!(
            digest("b", &raw(utf8)).is_some(),
            "a filename in UTF-8, as browsers send it"
        );
        assert_ne!(digest("b", &raw(utf8)), digest("b", &raw(other)));
        assert_eq!(fp("b", &raw(utf8)), fp("c", &form("c", &[(&[utf8], b"x")])));
    }

    #[test]
    fn a_form_is_never_a_body_of_bytes_and_the_boundary_is_left_out_of_the_head_only_then() {
        let body = body_of("b", &upload(PDF, "f", "file", "text/plain"));
        let policy = policy(FingerprintBody::Bytes);
        let as_form = fp_with(&policy, "multipart/form-data; boundary=b", &body);
        let as_bytes = fp_with(&policy, "multipart/form-data", &body);
        assert_ne!(as_form, as_bytes);
        assert_ne!(
            fp_with(&policy, "multipart/form-data; boundary=zz", &body),
            fp_with(&policy, "multipart/form-data; boundary=yy", &body),
            "a body that is not its declared form counts byte for byte, with its Content-Type"
        );
        let mut hash = Sha256::new();
        for field in [&b"POST"[..], b"/upload", b"content-type"] {
            super::field(&mut hash, field);
        }
        count(&mut hash, 1);
        super::field(&mut hash, b"multipart/form-data");
        super::field(&mut hash, b"multipart");
        super::field(&mut hash, &digest("b", &body).unwrap());
        assert_eq!(as_form, <[u8; 32]>::from(hash.finalize()));
    }

    #[test]
    fn only_a_form_type_with_one_valid_boundary_is_read() {
        let boundary = |value: &str| Form::parse(value.as_bytes()).map(|f| f.boundary.to_vec());
        assert_eq!(
            boundary("multipart/form-data; boundary=abc"),
            Some(b"abc".to_vec())
        );
        assert_eq!(
            boundary("multipart/form-data ; charset=utf-8;boundary=\"a b:c\""),
            Some(b"a b:c".to_vec())
        );
        for value in [
            "multipart/mixed; boundary=abc",
            "multipart/form-data",
            "multipart/form-data; boundary=",
            "multipart/form-data; boundary=a; boundary=b",
            "multipart/form-data; boundary=\"a\\\"b\"",
            "multipart/form-data; boundary=\"abc",
            "multipart/form-data; boundary=\"ends in space \"",
            "multipart/form-data; boundary=abc junk",
            "multipart/form-data; boundary=abc; boundary*=utf-8''xyz",
            "multipart/form-data; boundary*=utf-8''xyz; boundary=abc",
            "multipart/form-data; boundary=abc; BOUNDARY*0=x; boundary*1=y",
            "multipart/form-data; boundary*=utf-8''xyz",
            &format!("multipart/form-data; boundary={}", "x".repeat(71)),
        ] {
            assert_eq!(boundary(value), None, "{value}");
        }
        assert_eq!(
            boundary("multipart/form-data; boundary=abc; boundaryx=y; x*=z"),
            Some(b"abc".to_vec()),
            "only the boundary's own extended forms"
        );
        let form = Form::parse(b"multipart/form-data; boundary=abc; charset=utf-8").unwrap();
        assert_eq!(
            form.without_boundary().concat(),
            b"multipart/form-data; charset=utf-8"
        );
    }

    #[test]
    fn a_body_that_is_not_its_form_has_no_digest() {
        let whole = form("b", &[(&["Content-Disposition: form-data; name=\"a\""], b"1")]);
        assert!(digest("b", &whole).is_some());
        let bare_lf = form("b", &[(&["Content-Disposition: form-data; name=\"a\"\n"], b"1")]);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("no closing boundary", whole[..whole.len() - 8].to_vec()),
            ("boundary not in the body", form("other", &[(&[], b"1")])),
            ("no parts", b"--b--\r\n".to_vec()),
            ("empty", Vec::new()),
            (
                "a longer boundary in the content",
                [&b"--b\r\n\r\n1\r\n--bb\r\n"[..], b"--b--"].concat(),
            ),
            ("a part head with a bare LF", bare_lf),
            (
                "a part head without its blank line",
                b"--b\r\nName: v\r\n--b--".to_vec(),
            ),
        ];
        for (why, body) in cases {
            assert_eq!(digest("b", &body), None, "{why}");
        }
    }

    #[test]
    fn a_nested_form_counts_as_its_part_bytes() {
        let inner = form("inner", &[(&["Content-Type: text/plain"], b"x")]);
        let outer = |b: &str| {
            form(
                b,
                &[(
                    &["Content-Type: multipart/mixed; boundary=inner"],
                    inner.as_slice(),
                )],
            )
        };
        assert_eq!(digest("o1", &outer("o1")), digest("o2", &outer("o2")));
        assert!(digest("o1", &outer("o1")).is_some());
    }

    #[test]
    fn limits_make_a_form_count_byte_for_byte() {
        let empty: Part<'_> = (&[], b"");
        let many = form("b", &vec![empty; MAX_PARTS]);
        assert!(digest("b", &many).is_some(), "{MAX_PARTS} parts");
        let too_many = form("b", &vec![empty; 100_000]);
        assert_eq!(digest("b", &too_many), None);
        assert_ne!(fp("b", &too_many), fp("c", &form("c", &vec![empty; 100_000])));
        let long = format!("X-Long: {}", "v".repeat(MAX_PART_HEAD));
        assert_eq!(digest("b", &form("b", &[(&[long.as_str()], b"1")])), None);
        let lines: Vec<String> = (0..=MAX_PART_HEADERS).map(|i| format!("X-{i}: v")).collect();
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        assert_eq!(digest("b", &form("b", &[(&lines, b"1")])), None);
        assert!(digest("b", &form("b", &[(&lines[1..], b"1")])).is_some());
    }

    #[test]
    fn a_form_is_read_without_working_memory() {
        let body = body_of("b", &upload(PDF, "f.pdf", "file", "application/pdf"));
        let uri: Uri = "/upload".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("multipart/form-data; boundary=b"),
        );
        let mut refuse = |_: usize| false;
        let mut scratch = Scratch::within(&mut refuse);
        let policy = policy(FingerprintBody::Json);
        let read = fingerprint(&policy, &Method::POST, &uri, &headers, &body, &mut scratch);
        assert_eq!(
            read.unwrap(),
            fp_with(&policy, "multipart/form-data; boundary=b", &body)
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let seeds: [&[u8]; 6] = [
            b"--b",
            b"--b\r\n",
            b"--b\r\n\r\n",
            b"--b\r\n\r\n\r\n--b",
            b"\r\n--b\r\n:\r\n\r\n\r\n--b--",
            b"--b--",
        ];
        for seed in seeds {
            for cut in 0..=seed.len() {
                let _ = digest("b", &seed[..cut]);
                let _ = fp("b", &seed[..cut]);
            }
        }
        let _ = fp_with(
            &policy(FingerprintBody::Json),
            "multipart/form-data; boundary=\"",
            b"",
        );
        let _ = fp_with(&policy(FingerprintBody::Json), "multipart/form-data;;", b"");
    }
}
