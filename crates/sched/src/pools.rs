//! Fixed pools handed out by the scheduler: KV pages ([`PagePool`]) and DeltaNet state slots
//! ([`SlotPool`]). Both are created with the capacity of the static plan and never grow; the ids
//! index memory the backend allocated once at start-up.

/// KV-cache pages of `page_size` tokens, reference-counted: a page is shared by every sequence and
/// prefix-cache entry that holds it, and returns to the free list when the last one lets go.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    /// Free page ids; the lowest ids are handed out first.
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl PagePool {
    pub fn new(capacity: usize, page_size: usize) -> Self {
        assert!(page_size > 0, "page_size must be > 0");
        Self { page_size, free: (0..capacity as u32).rev().collect(), refs: vec![0; capacity] }
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
    /// Takes `n` pages (one reference each), or none if fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let pages: Vec<u32> = self.free.split_off(self.free.len() - n).into_iter().rev().collect();
        for &p in &pages {
            debug_assert_eq!(self.refs[p as usize], 0);
            self.refs[p as usize] = 1;
        }
        Some(pages)
    }
    /// Adds a reference to a page in use.
    pub fn retain(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        assert!(*r > 0, "retaining free page {page}");
        *r += 1;
    }
    /// Drops one reference from each page; pages nobody holds become free.
    pub fn give_back(&mut self, pages: impl IntoIterator<Item = u32>) {
        for p in pages {
            let r = &mut self.refs[p as usize];
            assert!(*r > 0, "page {p} released more often than taken");
            *r -= 1;
            if *r == 0 {
                self.free.push(p);
            }
        }
    }
    /// References currently held on `page`.
    pub fn refs(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }
    /// Panics if the free list and the reference counts disagree with `references_held`.
    pub fn assert_consistent(&self, references_held: usize) {
        let used = self.refs.iter().filter(|r| **r > 0).count();
        assert_eq!(used + self.free.len(), self.capacity(), "page pool: used + free != capacity");
        let total: usize = self.refs.iter().map(|r| *r as usize).sum();
        assert_eq!(total, references_held, "page pool: references != references held");
        for &p in &self.free {
            assert_eq!(self.refs[p as usize], 0, "free page {p} still referenced");
        }
    }
}

/// DeltaNet state slots (one per sequence in flight).
#[derive(Debug)]
pub struct SlotPool {
    capacity: usize,
    free: Vec<u32>,
}

impl SlotPool {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, free: (0..capacity as u32).rev().collect() }
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }
    pub fn give_back(&mut self, slot: u32) {
        assert!(!self.free.contains(&slot), "slot {slot} returned twice");
        self.free.push(slot);
    }
}
