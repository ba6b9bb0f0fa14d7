//! A response body's bytes in coalesced blocks, addressed by offset from the body's first byte: what the
//! response's log (`attach/log.rs`) keeps. Small frames are copied into a block that fills up to the
//! block size, and a frame of that size or more is a block of its own, so a body of tiny frames costs its
//! bytes, not an entry (and perhaps a pinned read buffer) per frame. Reads hand out at most one block: a
//! slice of a sealed block, or a copy of the unread part of the block still filling. Touches nothing but
//! its own memory.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

/// The size of a block while the body is written.
pub(crate) const BLOCK: usize = 16 * 1024;

/// A body's bytes from the oldest one kept to the newest written.
pub(super) struct Blocks {
    /// The most bytes a block fills up to; a frame this long or longer is a block of its own.
    size: usize,
    /// Full blocks, oldest first, each with the offset of its first byte.
    sealed: VecDeque<(u64, Bytes)>,
    /// The block still filling, which starts at `filling_at` (where the sealed ones end).
    filling: BytesMut,
    filling_at: u64,
}

impl Blocks {
    pub(super) fn new(size: usize) -> Blocks {
        Blocks {
            size: size.max(1),
            sealed: VecDeque::new(),
            filling: BytesMut::new(),
            filling_at: 0,
        }
    }

    /// The offset after the last byte written.
    pub(super) fn end(&self) -> u64 {
        self.filling_at + self.filling.len() as u64
    }

    /// The offset of the oldest byte still kept.
    pub(super) fn start(&self) -> u64 {
        self.sealed.front().map_or(self.filling_at, |(at, _)| *at)
    }

    /// Adds `data` after the last byte written; `true` if that closed a block.
    pub(super) fn write(&mut self, data: &Bytes) -> bool {
        if data.is_empty() {
            return false;
        }
        if data.len() >= self.size {
            self.seal();
            self.sealed.push_back((self.filling_at, data.clone()));
            self.filling_at += data.len() as u64;
            return true;
        }
        let full = self.filling.len() + data.len() > self.size;
        if full {
            self.seal();
        }
        if self.filling.capacity() == 0 {
            self.filling = BytesMut::with_capacity(self.size);
        }
        self.filling.extend_from_slice(data);
        full
    }

    /// Closes the block still filling. One less than half full is copied to its length, so that a
    /// block closed early (a large frame came) does not keep a whole block's room.
    fn seal(&mut self) {
        let len = self.filling.len();
        if len == 0 {
            return;
        }
        let block = if len < self.filling.capacity() / 2 {
            let copy = Bytes::copy_from_slice(&self.filling);
            self.filling.clear();
            copy
        } else {
            std::mem::take(&mut self.filling).freeze()
        };
        self.sealed.push_back((self.filling_at, block));
        self.filling_at += len as u64;
    }

    /// The bytes from `from` up to `upto` (exclusive), or as many of them as lie in one block; `None`
    /// when `from` is no longer kept or nothing is asked for.
    pub(super) fn read(&self, from: u64, upto: u64) -> Option<Bytes> {
        if from >= upto || from < self.start() || upto > self.end() {
            return None;
        }
        if from >= self.filling_at {
            let start = usize::try_from(from - self.filling_at).ok()?;
            let end = usize::try_from(upto - self.filling_at).ok()?;
            return Some(Bytes::copy_from_slice(&self.filling[start..end]));
        }
        let index = self
            .sealed
            .partition_point(|(at, block)| at + block.len() as u64 <= from);
        let (at, block) = self.sealed.get(index)?;
        let start = usize::try_from(from - at).ok()?;
        let end = usize::try_from(upto.min(at + block.len() as u64) - at).ok()?;
        Some(block.slice(start..end))
    }

    /// Lets go of every sealed block that ends at or before `offset`; and of the filling one's bytes
    /// too when `offset` is past them all.
    pub(super) fn forget_before(&mut self, offset: u64) {
        while self
            .sealed
            .front()
            .is_some_and(|(at, block)| at + block.len() as u64 <= offset)
        {
            self.sealed.pop_front();
        }
        if self.sealed.is_empty() && offset >= self.end() {
            self.filling_at = self.end();
            self.filling = BytesMut::new();
        }
    }

    /// Lets go of every byte, keeping the offsets.
    pub(super) fn clear(&mut self) {
        self.forget_before(self.end());
    }

    /// The whole body as one run of bytes, if every byte from the first is still kept. The blocks are
    /// then slices of it, so the bytes are in memory once.
    pub(super) fn whole(&mut self) -> Option<Bytes> {
        if self.start() != 0 {
            return None;
        }
        self.seal();
        if self.sealed.len() <= 1 {
            return Some(self.sealed.front().map(|(_, b)| b.clone()).unwrap_or_default());
        }
        let mut whole = BytesMut::with_capacity(usize::try_from(self.end()).ok()?);
        for (_, block) in &self.sealed {
            whole.extend_from_slice(block);
        }
        let whole = whole.freeze();
        for (at, block) in &mut self.sealed {
            let start = usize::try_from(*at).ok()?;
            *block = whole.slice(start..start + block.len());
        }
        Some(whole)
    }

    /// Bytes of memory the kept blocks take, room included.
    #[cfg(test)]
    pub(super) fn footprint(&self) -> usize {
        self.sealed.iter().map(|(_, b)| b.len()).sum::<usize>() + self.filling.capacity()
    }

    #[cfg(test)]
    pub(super) fn sealed_lens(&self) -> Vec<usize> {
        self.sealed.iter().map(|(_, b)| b.len()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks_of(size: usize, frames: &[&str]) -> Blocks {
        let mut blocks = Blocks::new(size);
        for frame in frames {
            blocks.write(&Bytes::copy_from_slice(frame.as_bytes()));
        }
        blocks
    }

    /// Everything from `from` to the end, read as a follower does: a block at a time.
    fn read_all(blocks: &Blocks, mut from: u64) -> (String, Vec<usize>) {
        let (mut text, mut reads) = (String::new(), Vec::new());
        while let Some(chunk) = blocks.read(from, blocks.end()) {
            from += chunk.len() as u64;
            reads.push(chunk.len());
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        (text, reads)
    }

    #[test]
    fn small_frames_fill_blocks_and_reads_cross_block_boundaries_a_block_at_a_time() {
        let blocks = blocks_of(8, &["abc", "def", "ghi", "jk", "lmnop", "q"]);
        assert_eq!(blocks.sealed_lens(), vec![6, 5], "frames are never split");
        assert_eq!(read_all(&blocks, 0), ("abcdefghijklmnopq".into(), vec![6, 5, 6]));
        assert_eq!(read_all(&blocks, 4), ("efghijklmnopq".into(), vec![2, 5, 6]));
        assert_eq!(blocks.read(7, 9).as_deref(), Some(&b"hi"[..]), "within one block");
        assert_eq!(
            blocks.read(9, 17).as_deref(),
            Some(&b"jk"[..]),
            "up to the block's end"
        );
    }

    #[test]
    fn a_large_frame_is_a_block_of_its_own_and_is_not_copied() {
        let large = Bytes::from(vec![b'x'; 20]);
        let mut blocks = blocks_of(8, &["ab"]);
        blocks.write(&large);
        blocks.write(&Bytes::from_static(b"cd"));
        assert_eq!(blocks.sealed_lens(), vec![2, 20]);
        let read = blocks.read(2, blocks.end()).unwrap();
        assert_eq!(read.as_ptr(), large.as_ptr(), "the frame's own bytes");
    }

    #[test]
    fn a_read_of_the_filling_block_copies_only_its_unread_part() {
        let mut blocks = blocks_of(BLOCK, &["abcdef"]);
        let tail = blocks.read(4, 6).unwrap();
        assert_eq!(&tail[..], b"ef");
        blocks.write(&Bytes::from_static(b"gh"));
        assert_eq!(&tail[..], b"ef", "a copy, which later writes leave alone");
        assert_eq!(blocks.read(6, blocks.end()).as_deref(), Some(&b"gh"[..]));
    }

    #[test]
    fn forgotten_bytes_cannot_be_read_and_the_rest_can() {
        let mut blocks = blocks_of(4, &["abc", "def", "gh"]);
        blocks.forget_before(5);
        assert_eq!(blocks.start(), 3, "the block holding offset 5 stays");
        assert_eq!(blocks.read(2, 8), None);
        assert_eq!(read_all(&blocks, 3).0, "defgh");
        blocks.forget_before(blocks.end());
        assert_eq!((blocks.start(), blocks.end(), blocks.footprint()), (8, 8, 0));
        blocks.write(&Bytes::from_static(b"ij"));
        assert_eq!(read_all(&blocks, 8).0, "ij", "offsets go on after a forget");
    }

    #[test]
    fn the_whole_body_is_one_run_and_the_blocks_become_slices_of_it() {
        let mut blocks = blocks_of(4, &["abc", "def", "g"]);
        let whole = blocks.whole().unwrap();
        assert_eq!(&whole[..], b"abcdefg");
        let read = blocks.read(3, 6).unwrap();
        assert_eq!(
            read.as_ptr(),
            whole[3..].as_ptr(),
            "read from the whole body's bytes"
        );
        assert_eq!(blocks_of(4, &[]).whole().as_deref(), Some(&b""[..]));
        let mut forgotten = blocks_of(4, &["abc", "def"]);
        forgotten.forget_before(3);
        assert_eq!(forgotten.whole(), None, "the beginning is gone");
    }
}
