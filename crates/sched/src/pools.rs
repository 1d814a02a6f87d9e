//! Fixed pools handed out by the scheduler: KV pages ([`PagePool`]) and DeltaNet state slots
//! ([`SlotPool`]). Both are created with the capacity of the static plan and never grow; the ids
//! index memory the backend allocated once at start-up.

/// KV-cache pages of `page_size` tokens.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    capacity: usize,
    /// Free page ids; the lowest ids are handed out first (LIFO over a sorted start).
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl PagePool {
    pub fn new(capacity: usize, page_size: usize) -> Self {
        assert!(page_size > 0, "page_size must be > 0");
        Self { page_size, capacity, free: (0..capacity as u32).rev().collect(), in_use: vec![false; capacity] }
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
    /// Takes `n` pages, or none if fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            debug_assert!(!self.in_use[p as usize]);
            self.in_use[p as usize] = true;
        }
        Some(pages.into_iter().rev().collect())
    }
    pub fn give_back(&mut self, pages: impl IntoIterator<Item = u32>) {
        for p in pages {
            assert!(self.in_use[p as usize], "page {p} returned twice");
            self.in_use[p as usize] = false;
            self.free.push(p);
        }
    }
    /// Panics if the free list and the in-use map disagree.
    pub fn assert_consistent(&self, pages_held_by_sequences: usize) {
        let used = self.in_use.iter().filter(|u| **u).count();
        assert_eq!(used + self.free.len(), self.capacity, "page pool: used + free != capacity");
        assert_eq!(used, pages_held_by_sequences, "page pool: pages in use != pages held by sequences");
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
