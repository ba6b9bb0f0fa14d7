//! Runs whenever a key source (`key/pointer.rs`) or the JSON fingerprint (`key/canonical.rs`) reads a
//! body: the one place a body is parsed as JSON, by streaming (json-event-parser's events over the bytes;
//! no tree is built), under the limits every reader shares. A body is JSON only when it is one RFC 8259
//! text with no byte-order mark and at most [`MAX_DEPTH`] arrays and objects open at once; working
//! memory beyond the body (a string with escapes decoded, a reader's own lists) is taken from a
//! [`Scratch`] allowance before it is used. Also tracks where the reader is against a few RFC 6901
//! pointers ([`Paths`]). Touches nothing but the bytes and the allowance.

use std::borrow::Cow;

use json_event_parser::{JsonEvent, SliceJsonParser};

/// Arrays and objects open at once beyond which a body is not JSON: serde_json's limit, so a body that
/// parsed before parses now.
pub const MAX_DEPTH: usize = 127;

/// The smallest piece a [`Scratch`] asks its budget for, so small bodies ask once.
const CHUNK: usize = 4096;

/// Why a reader stopped before the end of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The body is not JSON (or is nested deeper than [`MAX_DEPTH`]).
    NotJson,
    /// The working memory it needs is more than the budget can supply now.
    OverBudget,
}

/// Working memory a parse may use beyond the body: taken before use, given back after, and granted
/// by the budget in pieces of at least [`CHUNK`] bytes (growing by half of what is held), so asking
/// stays rare. Without a budget ([`Scratch::unbounded`]) every request is granted.
pub struct Scratch<'g> {
    used: usize,
    granted: usize,
    peak: usize,
    more: Option<&'g mut dyn FnMut(usize) -> bool>,
}

impl Scratch<'static> {
    /// An allowance without a budget, for callers that bound the body themselves (and tests).
    pub fn unbounded() -> Scratch<'static> {
        Scratch {
            used: 0,
            granted: 0,
            peak: 0,
            more: None,
        }
    }
}

impl<'g> Scratch<'g> {
    /// An allowance that asks `more(bytes)` for room, which answers whether the budget granted it.
    pub fn within(more: &'g mut dyn FnMut(usize) -> bool) -> Scratch<'g> {
        Scratch {
            used: 0,
            granted: 0,
            peak: 0,
            more: Some(more),
        }
    }

    /// Takes `bytes` of the allowance, asking the budget for more when it runs short.
    pub fn take(&mut self, bytes: usize) -> Result<(), Stop> {
        let needed = self.used.saturating_add(bytes);
        if needed > self.granted {
            let ask = (needed - self.granted).max(CHUNK).max(self.granted / 2);
            if let Some(more) = self.more.as_mut()
                && !more(ask)
            {
                return Err(Stop::OverBudget);
            }
            self.granted = self.granted.saturating_add(ask);
        }
        self.used = needed;
        self.peak = self.peak.max(needed);
        Ok(())
    }

    /// Gives back `bytes` taken before (the budget keeps them granted until the parse ends).
    pub fn give_back(&mut self, bytes: usize) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// The most that was in use at once.
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// What the budget granted in all.
    pub fn granted(&self) -> usize {
        self.granted
    }
}

/// A body's JSON events, one at a time, `Ok(None)` at its end. Refuses a byte-order mark (RFC 8259
/// forbids sending one; serde_json refuses it too) and nesting deeper than [`MAX_DEPTH`]. A string the
/// parser had to copy (it held escapes) is charged to the allowance until the next event.
pub struct Reader<'a> {
    parser: SliceJsonParser<'a>,
    depth: usize,
    copied: usize,
    done: bool,
}

impl<'a> Reader<'a> {
    /// A reader of `body`.
    pub fn new(body: &'a [u8]) -> Reader<'a> {
        Reader {
            parser: SliceJsonParser::new(body),
            depth: 0,
            copied: 0,
            done: body.starts_with(b"\xEF\xBB\xBF"),
        }
    }

    /// The next event; `Err(Stop::NotJson)` from the first byte that is not JSON on.
    pub fn next(&mut self, scratch: &mut Scratch<'_>) -> Result<Option<JsonEvent<'a>>, Stop> {
        scratch.give_back(std::mem::take(&mut self.copied));
        if self.done {
            return Err(Stop::NotJson);
        }
        let event = match self.parser.parse_next() {
            Ok(JsonEvent::Eof) => {
                self.done = true;
                return Ok(None);
            }
            Ok(event) => event,
            Err(_) => {
                self.done = true;
                return Err(Stop::NotJson);
            }
        };
        self.count_depth(&event)?;
        self.charge_copy(&event, scratch)?;
        Ok(Some(event))
    }

    fn count_depth(&mut self, event: &JsonEvent<'_>) -> Result<(), Stop> {
        match event {
            JsonEvent::StartArray | JsonEvent::StartObject => {
                self.depth += 1;
                if self.depth > MAX_DEPTH {
                    self.done = true;
                    return Err(Stop::NotJson);
                }
            }
            JsonEvent::EndArray | JsonEvent::EndObject => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
        Ok(())
    }

    fn charge_copy(&mut self, event: &JsonEvent<'_>, scratch: &mut Scratch<'_>) -> Result<(), Stop> {
        if let JsonEvent::String(Cow::Owned(text)) | JsonEvent::ObjectKey(Cow::Owned(text)) = event {
            scratch.take(text.capacity())?;
            self.copied = text.capacity();
        }
        Ok(())
    }
}

/// One RFC 6901 reference token, read once: the member name it names, and the array index it names
/// when it is one (digits without a leading zero, as serde_json read them).
struct Token {
    name: String,
    index: Option<usize>,
}

impl Token {
    fn parse(text: &str) -> Token {
        let name = text.replace("~1", "/").replace("~0", "~");
        let digits = !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit());
        let index = if digits && (name == "0" || !name.starts_with('0')) {
            name.parse().ok()
        } else {
            None
        };
        Token { name, index }
    }
}

/// One pointer as [`Paths`] follows it.
struct Pointer {
    tokens: Vec<Token>,
    /// How many of the open arrays and objects are on the pointer's path (always the outermost ones).
    open: usize,
    /// The member just named is the pointer's next token, so the next value is on its path.
    named: bool,
    /// Per token: the object on the path has already named it once.
    seen: Vec<bool>,
    /// An object on the path named the pointer's member twice.
    repeated: bool,
}

/// Where a reader is against a few RFC 6901 pointers, event by event. Remembers the open levels (at
/// most [`MAX_DEPTH`]) and, per pointer, how many of them are on its path, so it costs the same for
/// any length of body.
pub struct Paths {
    pointers: Vec<Pointer>,
    /// Per open array or object, outermost first: for an array, the index its next element takes.
    levels: Vec<Option<usize>>,
    hits: Vec<usize>,
}

impl Paths {
    /// Follows `pointers` (valid RFC 6901 pointers: empty, or `/` and a token, repeated).
    pub fn new<S: AsRef<str>>(pointers: &[S]) -> Paths {
        let pointers = pointers
            .iter()
            .map(|pointer| {
                let tokens: Vec<Token> = pointer.as_ref().split('/').skip(1).map(Token::parse).collect();
                Pointer {
                    seen: vec![false; tokens.len()],
                    tokens,
                    open: 0,
                    named: false,
                    repeated: false,
                }
            })
            .collect();
        Paths {
            pointers,
            levels: Vec::new(),
            hits: Vec::new(),
        }
    }

    /// Moves past `event`. Afterwards [`Paths::hits`] lists the pointers whose value `event` starts.
    pub fn step(&mut self, event: &JsonEvent<'_>) {
        self.hits.clear();
        match event {
            JsonEvent::ObjectKey(name) => self.name(name),
            JsonEvent::EndArray | JsonEvent::EndObject => self.close(),
            JsonEvent::Eof => {}
            JsonEvent::StartArray => self.value(Some(Some(0))),
            JsonEvent::StartObject => self.value(Some(None)),
            _ => self.value(None),
        }
    }

    /// The pointers whose value the last event started, by their place in the list given to `new`.
    pub fn hits(&self) -> &[usize] {
        &self.hits
    }

    /// Whether pointer `i` passes through an object that names the pointer's member twice: a body
    /// two parsers may read two ways (one takes the first, another the last).
    pub fn repeated(&self, i: usize) -> bool {
        self.pointers[i].repeated
    }

    fn name(&mut self, name: &str) {
        let depth = self.levels.len();
        for pointer in &mut self.pointers {
            pointer.named = pointer.open == depth
                && (1..=pointer.tokens.len()).contains(&depth)
                && pointer.tokens[depth - 1].name == name;
            if pointer.named {
                pointer.repeated |= pointer.seen[depth - 1];
                pointer.seen[depth - 1] = true;
            }
        }
    }

    /// A value starts; `opens` is `Some(level)` when it is an array (`Some(Some(0))`) or an object.
    fn value(&mut self, opens: Option<Option<usize>>) {
        let depth = self.levels.len();
        let index = match self.levels.last_mut() {
            Some(Some(next)) => {
                *next += 1;
                Some(*next - 1)
            }
            _ => None,
        };
        for (i, pointer) in self.pointers.iter_mut().enumerate() {
            let named = std::mem::take(&mut pointer.named);
            let on_path = pointer.open == depth
                && depth <= pointer.tokens.len()
                && match (depth, index) {
                    (0, _) => true,
                    (_, Some(index)) => pointer.tokens[depth - 1].index == Some(index),
                    (_, None) => named,
                };
            if !on_path {
                continue;
            }
            if depth == pointer.tokens.len() {
                self.hits.push(i);
            }
            if opens.is_some() {
                pointer.open = depth + 1;
                if let Some(seen) = pointer.seen.get_mut(depth) {
                    *seen = false;
                }
            }
        }
        if let Some(level) = opens {
            self.levels.push(level);
        }
    }

    fn close(&mut self) {
        self.levels.pop();
        let depth = self.levels.len();
        for pointer in &mut self.pointers {
            pointer.open = pointer.open.min(depth);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allowance_asks_its_budget_in_growing_pieces_and_stops_when_refused() {
        let mut asked = Vec::new();
        let mut budget = |bytes: usize| {
            asked.push(bytes);
            asked.iter().sum::<usize>() <= 100_000
        };
        let mut scratch = Scratch::within(&mut budget);
        scratch.take(10).unwrap();
        scratch.take(100).unwrap();
        scratch.give_back(110);
        scratch.take(4000).unwrap();
        assert_eq!(scratch.granted(), CHUNK, "one piece for small needs");
        scratch.take(50_000).unwrap();
        assert_eq!(scratch.take(60_000), Err(Stop::OverBudget));
        assert_eq!(scratch.peak(), 54_000);
        assert_eq!(asked[0], CHUNK);
        assert_eq!(asked.len(), 3);
    }

    fn events(body: &[u8]) -> Result<usize, Stop> {
        let mut reader = Reader::new(body);
        let mut scratch = Scratch::unbounded();
        let mut count = 0;
        while reader.next(&mut scratch)?.is_some() {
            count += 1;
        }
        Ok(count)
    }

    #[test]
    fn a_reader_reads_one_json_text_and_nothing_else() {
        assert_eq!(events(br#" {"a":[1,"x",null]} "#), Ok(8));
        for body in [
            &b"\xEF\xBB\xBF{}"[..],
            b"",
            b"{}{}",
            b"[1,]",
            b"\"\\ud800\"",
            b"\"\xff\"",
            b"[1",
            b"nul",
        ] {
            assert_eq!(
                events(body),
                Err(Stop::NotJson),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(events(nested(MAX_DEPTH).as_bytes()).is_ok());
        assert_eq!(events(nested(MAX_DEPTH + 1).as_bytes()), Err(Stop::NotJson));
    }

    #[test]
    fn a_string_the_parser_copies_is_charged_until_the_next_event() {
        let body = format!(r#"["{}\n", 1]"#, "a".repeat(10_000));
        let mut reader = Reader::new(body.as_bytes());
        let mut scratch = Scratch::unbounded();
        assert!(matches!(
            reader.next(&mut scratch),
            Ok(Some(JsonEvent::StartArray))
        ));
        assert!(matches!(
            reader.next(&mut scratch),
            Ok(Some(JsonEvent::String(_)))
        ));
        assert!(scratch.peak() >= 10_001);
        assert!(matches!(
            reader.next(&mut scratch),
            Ok(Some(JsonEvent::Number(_)))
        ));
        scratch.take(0).unwrap();
        assert_eq!(scratch.used, 0, "given back at the next event");
        let mut refuse = |_: usize| false;
        let mut reader = Reader::new(body.as_bytes());
        let mut scratch = Scratch::within(&mut refuse);
        assert!(reader.next(&mut scratch).is_ok());
        assert_eq!(reader.next(&mut scratch).err(), Some(Stop::OverBudget));
    }
}
