//! Runs while a keyed request is fingerprinted, on routes with `fingerprint_body = "json"`: a digest of
//! what a JSON body means, so a retry that re-serialises its body (members in another order, other
//! whitespace) still matches and one whose content changed does not. Built by streaming
//! (`key/json.rs`), member by member, never as a tree: each array is hashed as its elements arrive; each
//! object keeps one 48-byte entry per member (a 64-bit hash of its name, and the member itself when it is
//! short, else its SHA-256) and, when it closes, hashes the entries in the order of their names' hashes.
//! Memory grows with the nesting and the widest object, not with the body, and is charged to the
//! allowance. The members `fingerprint_exclude` names are left out. A body that is not I-JSON
//! (RFC 7493) — not JSON, nested too deep, or with an object that names a member twice, which parsers
//! read differently — has no digest, and counts byte for byte (as does, by chance, one whose object
//! holds two names with one 64-bit hash). The digests are SHA-256 by ring (already linked for TLS),
//! whose compiled routine hashes the many short inputs here as fast in a debug build as in a release
//! one. Pure functions of the body.

use json_event_parser::JsonEvent;
use ring::digest::{Context, SHA256};

use super::json::{Paths, Reader, Scratch, Stop};

/// The digest of `body`'s meaning without the members `exclude` names (RFC 6901 pointers to object
/// members; one that names nothing, or an array element, leaves nothing out). `Ok(None)` when the body
/// is not I-JSON; `Err(Stop::OverBudget)` when its objects need more memory than `scratch` can get.
pub fn digest(body: &[u8], exclude: &[String], scratch: &mut Scratch<'_>) -> Result<Option<[u8; 32]>, Stop> {
    let mut walk = Walk {
        paths: Paths::new(exclude),
        frames: Vec::new(),
        root: None,
    };
    let result = walk.run(body, scratch);
    walk.release(scratch);
    match result {
        Ok(()) => Ok(walk.root),
        Err(Stop::NotJson) => Ok(None),
        Err(Stop::OverBudget) => Err(Stop::OverBudget),
    }
}

/// One member of an open object, as its object's digest counts it.
struct Member {
    /// The 64-bit hash of its name: orders the members, and finds a name given twice.
    name: u64,
    entry: Entry,
}

/// A member's part of its object's digest.
enum Entry {
    /// A short member (a short name and a short scalar) as it is: name length, name, tag, text length,
    /// text, in the first `len` bytes.
    Inline { len: u8, bytes: [u8; INLINE] },
    /// The SHA-256 of the member: its name's length and name, then its value as an [`Item`].
    Hashed([u8; 32]),
    /// A member `fingerprint_exclude` names: it counts only when its name is given twice.
    Excluded,
}

/// The most bytes a member is kept as, rather than hashed.
const INLINE: usize = 31;

const MEMBER: usize = size_of::<Member>();

/// The member whose value is being read: its name, kept short or already hashed.
enum Named {
    Short { name: u64, len: u8, bytes: [u8; INLINE] },
    Long { name: u64, hash: Context },
}

/// An open array or object.
struct Frame {
    kind: Kind,
    /// This value is a member `fingerprint_exclude` names: it is read, then left out.
    excluded: bool,
}

enum Kind {
    /// Elements are hashed as they arrive.
    Array { hash: Context, count: u64 },
    /// Members wait for the object's end, to be put in order; `name` is the member whose value is being
    /// read.
    Object {
        members: Vec<Member>,
        name: Option<Named>,
    },
}

/// A value as its container counts it: a scalar's tag and text, or an array's or object's digest.
enum Item<'a> {
    Scalar(u8, &'a [u8]),
    Container(u8, [u8; 32]),
}

impl Item<'_> {
    /// Writes the item self-delimited: a tag, then a length and the text, or the 32-byte digest.
    fn write(&self, hash: &mut Context) {
        match self {
            Item::Scalar(tag, text) => {
                hash.update(&[*tag]);
                hash.update(&(text.len() as u64).to_be_bytes());
                hash.update(text);
            }
            Item::Container(tag, digest) => {
                hash.update(&[*tag]);
                hash.update(digest);
            }
        }
    }
}

/// FNV-1a, 64 bits: a stable hash of a member's name, to order an object's members. Two names with one
/// hash make the body count byte for byte; no one gains by forging that but the sender, who makes its own
/// retries differ.
fn name_hash(name: &[u8]) -> u64 {
    name.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Named {
    fn new(name: &str) -> Named {
        let hash = name_hash(name.as_bytes());
        let mut bytes = [0; INLINE];
        match u8::try_from(name.len()) {
            Ok(len) if name.len() < INLINE => {
                bytes[0] = len;
                bytes[1..=name.len()].copy_from_slice(name.as_bytes());
                Named::Short {
                    name: hash,
                    len: len + 1,
                    bytes,
                }
            }
            _ => {
                let mut context = Context::new(&SHA256);
                context.update(&(name.len() as u64).to_be_bytes());
                context.update(name.as_bytes());
                Named::Long {
                    name: hash,
                    hash: context,
                }
            }
        }
    }

    /// The member this name and `item` make.
    fn member(self, item: &Item<'_>, excluded: bool) -> Member {
        match self {
            _ if excluded => Member {
                name: self.hash(),
                entry: Entry::Excluded,
            },
            Named::Short { name, len, mut bytes } => match item {
                Item::Scalar(tag, text) if usize::from(len) + 2 + text.len() <= INLINE => {
                    let at = usize::from(len);
                    bytes[at] = *tag;
                    bytes[at + 1] = text.len() as u8;
                    bytes[at + 2..at + 2 + text.len()].copy_from_slice(text);
                    let len = (at + 2 + text.len()) as u8;
                    Member {
                        name,
                        entry: Entry::Inline { len, bytes },
                    }
                }
                _ => {
                    let name_len = usize::from(bytes[0]);
                    Named::Long {
                        name,
                        hash: {
                            let mut context = Context::new(&SHA256);
                            context.update(&(name_len as u64).to_be_bytes());
                            context.update(&bytes[1..=name_len]);
                            context
                        },
                    }
                    .member(item, false)
                }
            },
            Named::Long { name, mut hash } => {
                item.write(&mut hash);
                Member {
                    name,
                    entry: Entry::Hashed(finish(hash)),
                }
            }
        }
    }

    fn hash(&self) -> u64 {
        match self {
            Named::Short { name, .. } | Named::Long { name, .. } => *name,
        }
    }
}

/// The SHA-256 of what `hash` was given.
fn finish(hash: Context) -> [u8; 32] {
    let mut digest = [0; 32];
    digest.copy_from_slice(hash.finish().as_ref());
    digest
}

struct Walk {
    paths: Paths,
    frames: Vec<Frame>,
    root: Option<[u8; 32]>,
}

impl Walk {
    fn run(&mut self, body: &[u8], scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        let mut reader = Reader::new(body);
        while let Some(event) = reader.next(scratch)? {
            self.paths.step(&event);
            self.event(&event, scratch)?;
        }
        Ok(())
    }

    fn event(&mut self, event: &JsonEvent<'_>, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        match event {
            JsonEvent::ObjectKey(name) => {
                if let Some(Frame {
                    kind: Kind::Object { name: pending, .. },
                    ..
                }) = self.frames.last_mut()
                {
                    *pending = Some(Named::new(name));
                }
                Ok(())
            }
            JsonEvent::StartArray => self.open(
                Kind::Array {
                    hash: Context::new(&SHA256),
                    count: 0,
                },
                scratch,
            ),
            JsonEvent::StartObject => self.open(
                Kind::Object {
                    members: Vec::new(),
                    name: None,
                },
                scratch,
            ),
            JsonEvent::EndArray | JsonEvent::EndObject => self.close(scratch),
            JsonEvent::Null => self.scalar(Item::Scalar(b'n', b""), scratch),
            JsonEvent::Boolean(true) => self.scalar(Item::Scalar(b't', b""), scratch),
            JsonEvent::Boolean(false) => self.scalar(Item::Scalar(b'f', b""), scratch),
            JsonEvent::Number(text) => self.scalar(Item::Scalar(b'#', text.as_bytes()), scratch),
            JsonEvent::String(text) => self.scalar(Item::Scalar(b'"', text.as_bytes()), scratch),
            JsonEvent::Eof => Ok(()),
        }
    }

    /// Whether the value the last event started is a member `fingerprint_exclude` names.
    fn excluded(&self) -> bool {
        let in_object = matches!(
            self.frames.last(),
            Some(Frame {
                kind: Kind::Object { .. },
                ..
            })
        );
        in_object && !self.paths.hits().is_empty()
    }

    fn scalar(&mut self, item: Item<'_>, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        let excluded = self.excluded();
        self.emit(&item, excluded, scratch)
    }

    fn open(&mut self, kind: Kind, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        scratch.take(size_of::<Frame>())?;
        let excluded = self.excluded();
        self.frames.push(Frame { kind, excluded });
        Ok(())
    }

    fn close(&mut self, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        let Some(frame) = self.frames.pop() else {
            return Err(Stop::NotJson);
        };
        scratch.give_back(size_of::<Frame>());
        let item = match frame.kind {
            Kind::Array { mut hash, count } => {
                hash.update(&count.to_be_bytes());
                Item::Container(b'[', finish(hash))
            }
            Kind::Object { members, .. } => {
                let digest = object_digest(members, scratch);
                Item::Container(b'{', digest.ok_or(Stop::NotJson)?)
            }
        };
        self.emit(&item, frame.excluded, scratch)
    }

    /// Counts a finished value in its container (or as the whole document).
    fn emit(&mut self, item: &Item<'_>, excluded: bool, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        match self.frames.last_mut().map(|frame| &mut frame.kind) {
            None => {
                let mut hash = Context::new(&SHA256);
                item.write(&mut hash);
                self.root = Some(finish(hash));
                Ok(())
            }
            Some(Kind::Array { hash, count }) => {
                item.write(hash);
                *count += 1;
                Ok(())
            }
            Some(Kind::Object { members, name }) => {
                let named = name.take().ok_or(Stop::NotJson)?;
                push(members, named.member(item, excluded), scratch)
            }
        }
    }

    /// Gives back what the open frames still hold (a read that stopped early).
    fn release(&mut self, scratch: &mut Scratch<'_>) {
        for frame in self.frames.drain(..) {
            scratch.give_back(size_of::<Frame>());
            if let Kind::Object { members, .. } = frame.kind {
                scratch.give_back(members.capacity() * MEMBER);
            }
        }
    }
}

/// Adds a member, charging a larger list to the allowance before it is allocated (while the old one
/// still exists, as both do while the list moves).
fn push(members: &mut Vec<Member>, member: Member, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
    if members.len() == members.capacity() {
        let old = members.capacity();
        let new = (old * 2).max(4);
        scratch.take(new * MEMBER)?;
        members.reserve_exact(new - members.len());
        scratch.give_back(old * MEMBER);
    }
    members.push(member);
    Ok(())
}

/// An object's digest: its members' entries in the order of their names' hashes, after their count
/// (members left out count in neither), each tagged (`1`, a length and the member; `2` and its
/// SHA-256) so the two kinds never meet; `None` when two members share a name (or a name's hash).
fn object_digest(mut members: Vec<Member>, scratch: &mut Scratch<'_>) -> Option<[u8; 32]> {
    scratch.give_back(members.capacity() * MEMBER);
    members.sort_unstable_by_key(|member| member.name);
    if members.windows(2).any(|pair| pair[0].name == pair[1].name) {
        return None;
    }
    let counted = members
        .iter()
        .filter(|member| !matches!(member.entry, Entry::Excluded))
        .count();
    let mut hash = Context::new(&SHA256);
    hash.update(&(counted as u64).to_be_bytes());
    for member in &members {
        match &member.entry {
            Entry::Inline { len, bytes } => {
                hash.update(&[1, *len]);
                hash.update(&bytes[..usize::from(*len)]);
            }
            Entry::Hashed(digest) => {
                hash.update(&[2]);
                hash.update(digest);
            }
            Entry::Excluded => {}
        }
    }
    Some(finish(hash))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(body: &str, exclude: &[&str]) -> Option<[u8; 32]> {
        let exclude: Vec<String> = exclude.iter().map(|p| (*p).to_owned()).collect();
        digest(body.as_bytes(), &exclude, &mut Scratch::unbounded()).unwrap()
    }

    #[test]
    fn member_order_and_whitespace_do_not_count() {
        let compact = of(r#"{"amount":100,"currency":"eur","meta":{"a":1,"b":[1,2]}}"#, &[]);
        let reordered = of(
            "{ \"meta\" : { \"b\" : [ 1 , 2 ] , \"a\" : 1 } ,\n  \"currency\":\"eur\", \"amount\": 100 }",
            &[],
        );
        assert!(compact.is_some());
        assert_eq!(compact, reordered);
        assert_eq!(
            of(r#"{"a":"\u00e9\/"}"#, &[]),
            of(r#"{"\u0061":"é/"}"#, &[]),
            "escapes are decoded"
        );
    }

    #[test]
    fn any_change_of_content_counts() {
        let base = of(r#"{"amount":100,"items":[1,2]}"#, &[]);
        for other in [
            r#"{"amount":101,"items":[1,2]}"#,
            r#"{"amount":"100","items":[1,2]}"#,
            r#"{"amount":100.0,"items":[1,2]}"#,
            r#"{"amount":1e2,"items":[1,2]}"#,
            r#"{"amount":100,"items":[2,1]}"#,
            r#"{"amount":100,"items":[1,2],"x":null}"#,
            r#"{"amount":100,"items":[[1,2]]}"#,
            r#"{"amount":100,"items":[1,2,null]}"#,
            r#"{"Amount":100,"items":[1,2]}"#,
            r#"{"amount":100,"items":{"0":1,"1":2}}"#,
        ] {
            assert_ne!(base, of(other, &[]), "{other}");
        }
    }

    #[test]
    fn numbers_count_by_their_exact_text() {
        let a = of(r#"{"id":123456789012345678901234}"#, &[]);
        let b = of(r#"{"id":123456789012345678901235}"#, &[]);
        assert!(a.is_some());
        assert_ne!(a, b, "two 24-digit numbers that one f64 holds are two bodies");
        assert_ne!(of("1", &[]), of("1.0", &[]));
        assert_ne!(of("-0", &[]), of("0", &[]));
    }

    #[test]
    fn documents_that_would_run_together_stay_apart() {
        let pairs = [
            (r#"["ab","c"]"#, r#"["a","bc"]"#),
            (r#"{"a":"b","c":"d"}"#, r#"{"a":"b\"c","d":""}"#),
            (r#"[[],[]]"#, r#"[[[]]]"#),
            (r#"{"a":{}}"#, r#"{"a":[]}"#),
            (r#"[null]"#, r#"["n"]"#),
            (r#"[true]"#, r#"["t"]"#),
            (r#"1"#, r#""1""#),
            (r#"{"a":1}"#, r#"["a",1]"#),
            (r#"{"ab":"c"}"#, r#"{"a":"bc"}"#),
            (r#"[{"a":1},{"b":2}]"#, r#"[{"a":1,"b":2}]"#),
        ];
        for (a, b) in pairs {
            assert_ne!(of(a, &[]), of(b, &[]), "{a} vs {b}");
        }
    }

    #[test]
    fn short_and_long_members_count_alike_in_any_order_and_every_byte_counts() {
        // Around the size kept as it is (31 bytes) rather than hashed, with scalar and container values.
        let members: Vec<(String, String)> = [1, 12, 13, 14, 15, 28, 29, 30, 31, 40]
            .iter()
            .flat_map(|&n| {
                let name = "n".repeat(n);
                // A name and text of 28 bytes together are kept as they are; of 29, hashed.
                [
                    (
                        format!("{name}s"),
                        format!("\"{}\"", "v".repeat(27usize.saturating_sub(n).max(1))),
                    ),
                    (format!("{name}n"), "7".repeat(28usize.saturating_sub(n).max(1))),
                    (format!("{name}o"), "{\"a\":1}".to_owned()),
                    (format!("{name}t"), "true".to_owned()),
                ]
            })
            .collect();
        let object = |members: &[(String, String)]| {
            let text: Vec<String> = members.iter().map(|(n, v)| format!("\"{n}\":{v}")).collect();
            format!("{{{}}}", text.join(","))
        };
        let base = of(&object(&members), &[]);
        assert!(base.is_some());
        let mut reversed = members.clone();
        reversed.reverse();
        assert_eq!(base, of(&object(&reversed), &[]));
        for i in 0..members.len() {
            let mut changed = members.clone();
            changed[i].1 = match changed[i].1.as_str() {
                "true" => "false".to_owned(),
                value => value.replacen(['v', '7', '1'], "8", 1),
            };
            assert_ne!(base, of(&object(&changed), &[]), "{:?}", changed[i]);
            let mut renamed = members.clone();
            renamed[i].0.insert(0, 'x');
            assert_ne!(base, of(&object(&renamed), &[]), "{:?}", renamed[i]);
        }
    }

    #[test]
    fn excluded_members_are_left_out_wherever_they_are() {
        let exclude = [
            "/created",
            "/meta/sent_at",
            "/a~1b",
            "/absent/field",
            "/items/0",
            "/rows/1/at",
        ];
        let one = of(
            r#"{"amount":1,"created":1700000000,"meta":{"sent_at":"x","k":1},"a/b":1,"items":[1],"rows":[{"at":1},{"at":2}]}"#,
            &exclude,
        );
        let other = of(
            r#"{"amount":1,"created":{"deep":[1]},"meta":{"sent_at":"y","k":1},"a/b":[2],"items":[1],"rows":[{"at":1},{"at":3}]}"#,
            &exclude,
        );
        assert!(one.is_some());
        assert_eq!(one, other);
        let without = of(
            r#"{"amount":1,"meta":{"k":1},"items":[1],"rows":[{"at":1},{}]}"#,
            &exclude,
        );
        assert_eq!(one, without, "an excluded member counts as an absent one");
        let changed = of(
            r#"{"amount":2,"created":1700000000,"meta":{"sent_at":"x","k":1},"a/b":1,"items":[1],"rows":[{"at":1},{"at":2}]}"#,
            &exclude,
        );
        assert_ne!(one, changed);
        let element = of(
            r#"{"amount":1,"meta":{"k":1},"items":[2],"rows":[{"at":1},{}]}"#,
            &exclude,
        );
        assert_ne!(without, element, "array elements are not excluded");
        let first_row = of(
            r#"{"amount":1,"meta":{"k":1},"items":[1],"rows":[{"at":9},{}]}"#,
            &exclude,
        );
        assert_ne!(without, first_row, "only the row the pointer names");
    }

    #[test]
    fn an_object_that_names_a_member_twice_has_no_digest() {
        for body in [
            r#"{"a":1,"a":1}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":1}"#,
            r#"[1,{"x":{"a":[],"b":0,"a":{}}}]"#,
            r#"{"sent_at":1,"sent_at":2}"#,
        ] {
            assert_eq!(of(body, &["/sent_at"]), None, "{body}");
        }
        assert!(
            of(r#"{"a":{"x":1},"b":{"x":1}}"#, &[]).is_some(),
            "one name in two objects"
        );
    }

    #[test]
    fn bodies_that_are_not_json_have_no_digest() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        let just_too_deep = "[".repeat(128) + &"]".repeat(128);
        for body in [
            "",
            " ",
            "{",
            "not json",
            "{\"a\":1} trailing",
            "{\"a\":1",
            "[1,]",
            "\u{feff}{}",
            "\"\\udc00\"",
            &deep,
            &just_too_deep,
        ] {
            assert_eq!(of(body, &[]), None, "{body:.20}");
        }
        assert!(of(&("[".repeat(127) + &"]".repeat(127)), &[]).is_some());
    }

    #[test]
    fn memory_grows_with_the_widest_object_not_the_body() {
        let small_objects: Vec<String> = (0..100_000).map(|i| format!(r#"{{"id":{i},"n":"x"}}"#)).collect();
        let body = format!("[{}]", small_objects.join(","));
        let mut scratch = Scratch::unbounded();
        assert!(digest(body.as_bytes(), &[], &mut scratch).unwrap().is_some());
        assert!(
            scratch.peak() < 4096,
            "{} bytes for {} bytes of small objects",
            scratch.peak(),
            body.len()
        );

        let members: Vec<String> = (0..100_000).map(|i| format!(r#""m{i}":{i}"#)).collect();
        let wide = format!("{{{}}}", members.join(","));
        let mut scratch = Scratch::unbounded();
        assert!(digest(wide.as_bytes(), &[], &mut scratch).unwrap().is_some());
        let entries = 100_000 * MEMBER;
        assert!(
            scratch.peak() >= entries && scratch.peak() <= 3 * entries + 4096,
            "{} bytes for a 100k-member object",
            scratch.peak()
        );
    }

    #[test]
    fn a_budget_that_cannot_supply_the_members_stops_the_read() {
        let members: Vec<String> = (0..10_000).map(|i| format!(r#""m{i}":{i}"#)).collect();
        let wide = format!("{{{}}}", members.join(","));
        let mut granted = 0;
        let mut grow = |bytes: usize| {
            granted += bytes;
            granted <= 64 * 1024
        };
        let mut scratch = Scratch::within(&mut grow);
        assert_eq!(digest(wide.as_bytes(), &[], &mut scratch), Err(Stop::OverBudget));
        let mut fits = |_: usize| true;
        let mut scratch = Scratch::within(&mut fits);
        assert!(digest(wide.as_bytes(), &[], &mut scratch).unwrap().is_some());
        assert!(scratch.granted() >= scratch.peak());
    }
}
