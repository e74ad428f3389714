//! Host-side tensors: the bytes of one weight, its shape and the storage format the backends
//! compute on directly. Owns nothing about models or devices; `model` produces these, `backend`
//! consumes them.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

pub mod blocks;
pub mod quantize;

pub use blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, QK_K};
pub use quantize::quantize_row;

/// Elements per quantization block of the 32-wide block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
/// and the Q8_1-style activation blocks).
pub const QK: usize = 32;

/// Storage formats a backend multiplies by without first inflating to f32.
///
/// The block layouts are byte-identical to GGML's so GGUF tensors are used straight from the map:
/// - `Q8_0`: per 32 values an f16 scale `d` and 32 `i8`; x = d·q.
/// - `Q4_0`: an f16 scale `d` and 16 bytes of nibbles; x = d·(q − 8); low nibbles hold values 0..16.
/// - `Q4_1`: f16 `d`, f16 `m` and 16 bytes of nibbles; x = d·q + m.
/// - `Q5_0`, `Q5_1`, and the 256-value K-quants `Q2K`…`Q6K`: see [`blocks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// A format serializes as its name (`f16`, `q4_k`, ...).
impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl DType {
    /// Every storage format, in a stable order.
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    /// The format called `name` ([`DType::name`]).
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes taken by `n` values; `n` must be a multiple of [`DType::block_len`].
    pub fn bytes_for(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }

    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => QK,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => QK_K,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            DType::Q4_1 => std::mem::size_of::<BlockQ4_1>(),
            DType::Q5_0 => std::mem::size_of::<BlockQ5_0>(),
            DType::Q5_1 => std::mem::size_of::<BlockQ5_1>(),
            DType::Q2K => std::mem::size_of::<BlockQ2K>(),
            DType::Q3K => std::mem::size_of::<BlockQ3K>(),
            DType::Q4K => std::mem::size_of::<BlockQ4K>(),
            DType::Q5K => std::mem::size_of::<BlockQ5K>(),
            DType::Q6K => std::mem::size_of::<BlockQ6K>(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// The 256-value super-block formats (multiplied by 256-value 8-bit activation blocks).
    pub fn is_k_quant(self) -> bool {
        self.block_len() == QK_K
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// Alignment of [`AlignedBuf`]: a page, as direct I/O needs.
pub const PAGE: usize = 4096;

/// A transparent huge page (x86-64, aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// Where [`Bytes::pack_huge`] starts each buffer: a cache line.
const PACK_ALIGN: usize = 64;

/// Ask the kernel to back the whole 2 MiB pages inside `len` bytes at `start` with transparent
/// huge pages (`madvise(MADV_HUGEPAGE)`; a hint, its failure changes nothing), before they are
/// first touched. Weights are read in runs scattered over the whole buffer (a layer's listed
/// neurons, a third of each bundle): with 4 KiB pages nearly every run begins with a TLB
/// miss. The buffers of less than two huge pages are left alone.
fn advise_huge_pages(start: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let start = start as usize;
        let first = start.next_multiple_of(HUGE_PAGE);
        let end = (start + len) / HUGE_PAGE * HUGE_PAGE;
        if end >= first + 2 * HUGE_PAGE {
            // SAFETY: the range lies inside the caller's own allocation; the advice
            // changes how pages are backed, never their contents.
            let r = unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE)
            };
            if r != 0 {
                tracing::debug!(
                    "madvise(MADV_HUGEPAGE): {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}

/// A page-aligned, zero-initialised heap buffer (direct I/O reads land here).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory; access goes through &/&mut borrows.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (rounded up to a whole page), not yet written: the allocation and its size,
    /// advised onto huge pages before anything touches it. Not `alloc_zeroed`: at this alignment
    /// it zeroes (touches) every page at once, before the pages could be advised huge. Fresh
    /// large allocations are untouched mappings.
    fn untouched(len: usize) -> (std::ptr::NonNull<u8>, usize) {
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        advise_huge_pages(raw, layout.size());
        (ptr, layout.size())
    }

    /// `len` bytes (rounded up to a whole page), zeroed.
    pub fn zeroed(len: usize) -> Self {
        let (ptr, size) = Self::untouched(len);
        // SAFETY: the allocation is `size` bytes, owned here.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        AlignedBuf { ptr, len }
    }

    /// `len` bytes (rounded up to a whole page) holding `items`, each moved into its range of
    /// `ranges` (ascending, each inside `len`) and dropped as soon as it is copied, the rest
    /// zeroed: at most one item is held twice, where copying them all first would hold every
    /// one twice. Advised onto huge pages as [`AlignedBuf::zeroed`] is.
    fn packed(len: usize, items: &mut [&mut Bytes], ranges: &[Range<usize>]) -> Self {
        debug_assert_eq!(items.len(), ranges.len());
        let (ptr, size) = Self::untouched(len);
        let raw = ptr.as_ptr();
        let mut end = 0;
        for (item, range) in items.iter_mut().zip(ranges) {
            let src = std::mem::take(&mut **item);
            let (start, n) = (range.start, src.len());
            assert!(
                start >= end && n == range.len() && range.end <= len,
                "packed items overlap"
            );
            // SAFETY: `end..start` and `start..start + n` lie inside the allocation (checked);
            // `src` is other memory.
            unsafe {
                std::ptr::write_bytes(raw.add(end), 0, start - end);
                std::ptr::copy_nonoverlapping(src.as_slice().as_ptr(), raw.add(start), n);
            }
            end = start + n;
        }
        // SAFETY: the tail lies inside the allocation.
        unsafe { std::ptr::write_bytes(raw.add(end), 0, size - end) };
        AlignedBuf { ptr, len }
    }

    /// Whole pages; buffers of huge pages aligned to one, so every page of them can be huge.
    fn layout(len: usize) -> std::alloc::Layout {
        let cap = len.div_ceil(PAGE).max(1) * PAGE;
        let align = if cap >= 2 * HUGE_PAGE {
            HUGE_PAGE
        } else {
            PAGE
        };
        std::alloc::Layout::from_size_align(cap, align).expect("page-aligned layout")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes available including the padding to a whole page.
    pub fn capacity(&self) -> usize {
        self.len.div_ceil(PAGE).max(1) * PAGE
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds `capacity() >= len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole page-rounded buffer (for reads of whole pages).
    pub fn padded_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `capacity()` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Bytes that are borrowed from a memory map (zero-copy weights), owned, or a range of a shared
/// page-aligned buffer (read from the store).
///
/// Owned bytes are backed by `u64` words so typed views (`f32`, `f16`, blocks) are always aligned.
#[derive(Clone)]
pub enum Bytes {
    Mapped {
        map: Arc<Mmap>,
        range: Range<usize>,
    },
    Owned {
        words: Arc<Vec<u64>>,
        len: usize,
    },
    Aligned {
        buf: Arc<AlignedBuf>,
        range: Range<usize>,
    },
}

impl Bytes {
    pub fn from_vec_f32(v: Vec<f32>) -> Self {
        Self::from_slice(bytemuck::cast_slice(&v))
    }

    pub fn from_slice(src: &[u8]) -> Self {
        let mut words = Self::zeroed_words(src.len());
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..src.len()].copy_from_slice(src);
        Bytes::Owned {
            words: Arc::new(words),
            len: src.len(),
        }
    }

    /// `len` zeroed bytes, owned (so they can be filled in place) and, where large, on huge
    /// pages as [`Bytes::from_slice`]'s are: a device weight the budgeted device or the CPU
    /// allocates, then fills.
    pub fn zeroed(len: usize) -> Self {
        Bytes::Owned {
            words: Arc::new(Self::zeroed_words(len)),
            len,
        }
    }

    /// Words for `len` bytes, zeroed. Zeroed large vectors are fresh, untouched mappings:
    /// advised before anything is written.
    fn zeroed_words(len: usize) -> Vec<u64> {
        let mut words = vec![0u64; len.div_ceil(8)];
        let bytes = bytemuck::cast_slice_mut::<u64, u8>(&mut words);
        advise_huge_pages(bytes.as_mut_ptr(), bytes.len());
        words
    }

    /// A view of `range` inside `map`; copied into owned storage when the start is not 8-byte
    /// aligned, so typed views never fail.
    pub fn mapped(map: Arc<Mmap>, range: Range<usize>) -> Self {
        let aligned = (map.as_ptr() as usize + range.start).is_multiple_of(8);
        if aligned {
            Bytes::Mapped { map, range }
        } else {
            Self::from_slice(&map[range])
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, range } => &map[range.clone()],
            Bytes::Owned { words, len } => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
            Bytes::Aligned { buf, range } => &buf.as_slice()[range.clone()],
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Bytes::Mapped { range, .. } | Bytes::Aligned { range, .. } => range.len(),
            Bytes::Owned { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self, Bytes::Mapped { .. })
    }

    /// `items` moved into one buffer on transparent huge pages, each then a range of it
    /// ([`Bytes::Aligned`], starting on a cache line) with the same bytes. Buffers read a few
    /// rows at a time at scattered places (the CPU's cold neurons) cross a 4 KiB page every
    /// few rows, and each crossing is a TLB miss that the prefetchers do not cover; buffers too
    /// small to hold a huge page of their own get one only together. Left as they are where
    /// all of them together are less than two huge pages. Not for buffers that are mapped for
    /// a device one by one: these then share one allocation.
    pub fn pack_huge(items: &mut [&mut Bytes]) {
        let mut ranges = Vec::with_capacity(items.len());
        let mut len = 0usize;
        for b in items.iter() {
            let start = len.next_multiple_of(PACK_ALIGN);
            len = start + b.len();
            ranges.push(start..len);
        }
        if len < 2 * HUGE_PAGE {
            return;
        }
        let buf = Arc::new(AlignedBuf::packed(len, items, &ranges));
        for (item, range) in items.iter_mut().zip(ranges) {
            **item = Bytes::Aligned {
                buf: buf.clone(),
                range,
            };
        }
    }
}

impl Default for Bytes {
    /// No bytes.
    fn default() -> Self {
        Bytes::Owned {
            words: Arc::new(Vec::new()),
            len: 0,
        }
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Bytes::Mapped { .. } => "mapped",
            Bytes::Owned { .. } => "owned",
            Bytes::Aligned { .. } => "aligned",
        };
        write!(f, "Bytes({kind}, {} bytes)", self.len())
    }
}

/// One weight on the host: a matrix of `rows × cols` (row-major, `cols` contiguous; a vector has
/// one row) in a backend storage format.
#[derive(Clone, Debug)]
pub struct HostTensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub data: Bytes,
}

impl HostTensor {
    pub fn from_f32(name: impl Into<String>, rows: usize, cols: usize, values: Vec<f32>) -> Self {
        debug_assert_eq!(values.len(), rows * cols);
        HostTensor {
            name: name.into(),
            rows,
            cols,
            dtype: DType::F32,
            data: Bytes::from_vec_f32(values),
        }
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.cols)
    }

    /// The raw bytes of row `r`. A row past the tensor (a token id past the embedding's
    /// vocabulary) is an error, never an out-of-bounds slice.
    pub fn row(&self, r: usize) -> Result<&[u8], RowOutOfRange> {
        let rb = self.row_bytes();
        let bytes = (r < self.rows)
            .then(|| r.checked_mul(rb))
            .flatten()
            .and_then(|start| self.data.as_slice().get(start..start.checked_add(rb)?));
        bytes.ok_or_else(|| RowOutOfRange {
            name: self.name.clone(),
            row: r,
            rows: self.rows,
        })
    }

    /// Row `r` as f32 values, whatever the format.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), RowOutOfRange> {
        decode_row(self.dtype, self.row(r)?, out);
        Ok(())
    }

    /// The whole tensor as f32 values.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        let rb = self.row_bytes();
        if rb > 0 {
            let rows = self.data.as_slice().chunks_exact(rb);
            for (bytes, chunk) in rows.zip(out.chunks_mut(self.cols.max(1))) {
                decode_row(self.dtype, bytes, chunk);
            }
        }
        out
    }
}

/// A row asked of a tensor that does not have it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("row {row} of `{name}`, which has {rows} rows")]
pub struct RowOutOfRange {
    pub name: String,
    pub row: usize,
    pub rows: usize,
}

/// Encode f32 values into one row of `dtype` bytes (`out.len() == dtype.bytes_for(x.len())`):
/// round to nearest for the float formats; the block formats as llama.cpp's reference
/// quantizers do it ([`quantize::quantize_row`]). Q8_0 (per 32 values `d = amax / 127`,
/// `q = round(x / d)`, `d` kept as f16) is also what the CUDA KV kernel repeats bit for bit.
/// Always `Some` (the option is kept for callers that check).
pub fn encode_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Option<()> {
    quantize_row(dtype, x, out);
    Some(())
}

/// f16 values into f32 (exact): F16C eight at a time where the CPU has it, inlined into the
/// loop. The `half` crate's slice conversion calls a function per eight values, which made
/// decoding most of the time of attention over an f16 cache on the CPU.
pub fn f16_to_f32_slice(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    f16_runs_to_f32(&src[..n], (n, 0), &mut dst[..n], n);
}

/// `dst.len() / width` runs of `width` f16 values into `dst` as f32, one after another: run `r`
/// from `src[r · stride + col..]` (a block of a cache's rows, one head's columns of each) in one
/// call, F16C where the CPU has it.
pub fn f16_runs_to_f32(src: &[f16], (stride, col): (usize, usize), dst: &mut [f32], width: usize) {
    if width == 0 {
        return;
    }
    let run = |r: usize| &src[r * stride + col..][..width];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
        for (r, o) in dst.chunks_exact_mut(width).enumerate() {
            // SAFETY: the features were just detected; both slices are `width` long.
            unsafe { f16c_to_f32(run(r), o) };
        }
        return;
    }
    for (r, o) in dst.chunks_exact_mut(width).enumerate() {
        for (o, h) in o.iter_mut().zip(run(r)) {
            *o = h.to_f32();
        }
    }
}

/// Q8_0 blocks (their bytes, at any alignment: an f16 scale, 32 codes) into f32, as many
/// values as both `bytes` and `dst` hold: each value d · q, the same bits however it is
/// computed. Whole blocks AVX2 eight values at a time where the CPU has it: the baseline
/// build's SSE2 unpacking made decoding half the time of CPU attention over a Q8_0 cache.
pub fn q8_0_to_f32(bytes: &[u8], dst: &mut [f32]) {
    let bb = DType::Q8_0.block_bytes();
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        done = (bytes.len() / bb).min(dst.len() / QK);
        // SAFETY: the features were just detected; `done` whole blocks fit both slices.
        unsafe { q8_0_to_f32_avx2(&bytes[..done * bb], &mut dst[..done * QK]) };
    }
    for (b, o) in bytes.chunks_exact(bb).zip(dst.chunks_mut(QK)).skip(done) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        for (o, &q) in o.iter_mut().zip(&b[2..]) {
            *o = d * q as i8 as f32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q8_0_to_f32_avx2(bytes: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm_loadl_epi64, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps, _mm256_mul_ps,
        _mm256_set1_ps, _mm256_storeu_ps,
    };
    let bb = DType::Q8_0.block_bytes();
    for (b, o) in bytes.chunks_exact(bb).zip(dst.chunks_exact_mut(QK)) {
        let d = _mm256_set1_ps(f16::from_le_bytes([b[0], b[1]]).to_f32());
        for k in 0..QK / 8 {
            // SAFETY: 8 codes at 2 + 8k ≤ 26 of the block's 34 bytes; 8 floats at 8k of 32.
            unsafe {
                let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * k) as *const __m128i);
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * k), _mm256_mul_ps(d, v));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_to_f32(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 ≤ whole ≤ both lengths.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    for (o, h) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *o = h.to_f32();
    }
}

/// Decode one row of `dtype` bytes into f32 values (`out.len()` values). Reads bytes without
/// assuming any alignment, so it works on any slice.
pub fn decode_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let half = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(bytes) {
            // In bulk; exact either way.
            Ok(h) => f16_to_f32_slice(h, out),
            Err(_) => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half(b, 0);
                }
            }
        },
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Q8_0 => q8_0_to_f32(bytes, out),
        DType::Q4_0 | DType::Q4_1 => {
            let with_min = dtype == DType::Q4_1;
            for (b, o) in bytes
                .chunks_exact(dtype.block_bytes())
                .zip(out.chunks_mut(QK))
            {
                let d = half(b, 0);
                let (m, qs) = if with_min {
                    (half(b, 2), &b[4..])
                } else {
                    (0.0, &b[2..])
                };
                for (j, &q) in qs.iter().enumerate() {
                    let (lo, hi) = ((q & 0x0f) as f32, (q >> 4) as f32);
                    if with_min {
                        o[j] = d * lo + m;
                        o[j + QK / 2] = d * hi + m;
                    } else {
                        o[j] = d * (lo - 8.0);
                        o[j + QK / 2] = d * (hi - 8.0);
                    }
                }
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let with_min = dtype == DType::Q5_1;
            for (b, o) in bytes
                .chunks_exact(dtype.block_bytes())
                .zip(out.chunks_mut(QK))
            {
                blocks::decode_q5(b, o, with_min);
            }
        }
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => {
            let decode = match dtype {
                DType::Q2K => blocks::decode_q2k,
                DType::Q3K => blocks::decode_q3k,
                DType::Q4K => blocks::decode_q4k,
                DType::Q5K => blocks::decode_q5k,
                _ => blocks::decode_q6k,
            };
            for (b, o) in bytes
                .chunks_exact(dtype.block_bytes())
                .zip(out.chunks_mut(QK_K))
            {
                decode(b, o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers of every size come zeroed and page-aligned, huge ones aligned to a huge page
    /// (advised to be backed by them before first touch), and owned bytes copy their source
    /// whole at every size.
    #[test]
    fn buffers_of_every_size_are_zeroed_aligned_and_whole() {
        for len in [
            1usize,
            PAGE + 1,
            2 * HUGE_PAGE - 1,
            2 * HUGE_PAGE + 3 * PAGE + 5,
        ] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.padded_mut().iter().all(|&v| v == 0), "{len}");
            let align = if b.capacity() >= 2 * HUGE_PAGE {
                HUGE_PAGE
            } else {
                PAGE
            };
            assert!(
                (b.as_slice().as_ptr() as usize).is_multiple_of(align),
                "{len}"
            );
            b.as_mut_slice()[len - 1] = 7;
            assert_eq!(b.as_slice()[len - 1], 7);
            let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            assert_eq!(Bytes::from_slice(&src).as_slice(), &src[..], "{len}");
        }
    }

    /// Packed buffers keep their bytes, each starting on a cache line of one huge-page-aligned
    /// buffer with the padding zeroed; a set too small to hold two huge pages is left alone.
    #[test]
    fn packed_buffers_keep_their_bytes_in_one_huge_page_buffer() {
        let fill = |n: usize, seed: usize| -> Vec<u8> {
            (0..n).map(|i| ((i * 7 + seed) % 253) as u8).collect()
        };
        let lens = [HUGE_PAGE - 3, 5, 0, HUGE_PAGE + 77, 3 * PAGE + 1];
        let srcs: Vec<Vec<u8>> = lens.iter().enumerate().map(|(k, &n)| fill(n, k)).collect();
        let mut items: Vec<Bytes> = srcs.iter().map(|v| Bytes::from_slice(v)).collect();
        // One of them shared: packing copies it, the other holder keeps its bytes.
        let shared = items[1].clone();
        let mut refs: Vec<&mut Bytes> = items.iter_mut().collect();
        Bytes::pack_huge(&mut refs);
        let mut bufs = Vec::new();
        let mut end = 0;
        for (b, src) in items.iter().zip(&srcs) {
            assert_eq!(b.as_slice(), &src[..]);
            let Bytes::Aligned { buf, range } = b else {
                panic!("{b:?} not packed");
            };
            assert!(range.start.is_multiple_of(PACK_ALIGN) && range.start >= end);
            assert!(buf.as_slice()[end..range.start].iter().all(|&v| v == 0));
            end = range.end;
            bufs.push(buf.as_slice().as_ptr());
        }
        assert!(bufs.iter().all(|&p| p == bufs[0]));
        assert!((bufs[0] as usize).is_multiple_of(HUGE_PAGE));
        assert_eq!(shared.as_slice(), &srcs[1][..]);

        let small = fill(HUGE_PAGE, 9);
        let mut items = [Bytes::from_slice(&small), Bytes::from_slice(&small[..10])];
        let mut refs: Vec<&mut Bytes> = items.iter_mut().collect();
        Bytes::pack_huge(&mut refs);
        assert!(items.iter().all(|b| matches!(b, Bytes::Owned { .. })));
        assert_eq!(items[0].as_slice(), &small[..]);
    }

    /// A row past the tensor — a token id past a vocabulary that claims more rows than the
    /// embedding has (issue 39) — is an error naming the tensor, not a slice panic.
    #[test]
    fn a_row_past_the_tensor_is_an_error() {
        let t = HostTensor::from_f32(
            "token_embd.weight",
            3,
            2,
            (0..6).map(|i| i as f32).collect(),
        );
        let mut out = [0f32; 2];
        t.row_f32(2, &mut out).unwrap();
        assert_eq!(out, [4.0, 5.0]);
        let e = t.row_f32(3, &mut out).unwrap_err();
        assert_eq!((e.row, e.rows), (3, 3));
        assert!(e.to_string().contains("token_embd.weight"), "{e}");
        assert!(t.row(usize::MAX).is_err());
        // Rows claimed beyond the bytes held.
        let short = HostTensor {
            rows: 5,
            ..t.clone()
        };
        assert!(short.row(4).is_err());
        assert_eq!(short.to_f32().len(), 10);
    }

    /// The bulk Q8_0 decoder (AVX2 where the CPU has it; `decode_row` too) gives d · q for every
    /// code, bit for bit, extremes and a zero scale included.
    #[test]
    fn q8_0_blocks_decode_in_bulk_as_row_by_row() {
        let blocks: Vec<BlockQ8_0> = (0..37)
            .map(|b| BlockQ8_0 {
                d: f16::from_f32(if b == 5 {
                    0.0
                } else {
                    (b as f32 - 18.0) * 0.013
                }),
                qs: std::array::from_fn(|i| (((b * 31 + i * 7) % 256) as i32 - 128) as i8),
            })
            .collect();
        let mut bulk = vec![f32::NAN; 37 * QK];
        q8_0_to_f32(bytemuck::cast_slice(&blocks), &mut bulk);
        let want: Vec<f32> = blocks
            .iter()
            .flat_map(|b| b.qs.map(|q| b.d.to_f32() * q as f32))
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&bulk), bits(&want));
    }

    #[test]
    fn f16_slices_decode_every_value_as_its_own_conversion_does() {
        // Every f16 bit pattern, in slices whose lengths leave every remainder past the eights.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for len in [all.len(), 13, 8, 7, 1, 0] {
            for start in [0, 3] {
                let src = &all[start..(start + len).min(all.len())];
                let mut got = vec![7.0f32; src.len() + 1];
                f16_to_f32_slice(src, &mut got);
                for (i, (g, h)) in got.iter().zip(src).enumerate() {
                    let want = h.to_f32();
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "{:#06x} at {i}: {g} vs {want}",
                        h.to_bits()
                    );
                }
                assert_eq!(got[src.len()], 7.0, "nothing written past the source");
            }
        }
    }

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(DType::Q8_0.block_bytes(), 34);
        assert_eq!(DType::Q4_0.block_bytes(), 18);
        assert_eq!(DType::Q4_1.block_bytes(), 20);
        assert_eq!(DType::Q4_1.bytes_for(64), 40);
        assert_eq!(DType::Q5_0.block_bytes(), 22);
        assert_eq!(DType::Q5_1.block_bytes(), 24);
        assert_eq!(DType::Q2K.block_bytes(), 84);
        assert_eq!(DType::Q3K.block_bytes(), 110);
        assert_eq!(DType::Q4K.block_bytes(), 144);
        assert_eq!(DType::Q5K.block_bytes(), 176);
        assert_eq!(DType::Q6K.block_bytes(), 210);
        assert_eq!(DType::Q6K.bytes_for(512), 420);
    }

    #[test]
    fn every_dtype_parses_from_its_name() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::parse("q4_k"), Some(DType::Q4K));
        assert_eq!(DType::parse("iq4_xs"), None);
    }

    #[test]
    fn owned_bytes_roundtrip_f32() {
        let t = HostTensor::from_f32("x", 2, 3, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut row = [0f32; 3];
        t.row_f32(1, &mut row).unwrap();
        assert_eq!(row, [4.0, 5.0, 6.0]);
        assert_eq!(t.to_f32().len(), 6);
    }

    #[test]
    fn q4_1_decodes_low_then_high_nibbles() {
        let mut qs = [0u8; 16];
        qs[0] = 0x21; // value 0 -> 1, value 16 -> 2
        let b = BlockQ4_1 {
            d: f16::from_f32(0.5),
            m: f16::from_f32(-1.0),
            qs,
        };
        let mut out = [0f32; 32];
        decode_row(DType::Q4_1, bytemuck::bytes_of(&b), &mut out);
        assert_eq!(out[0], -0.5);
        assert_eq!(out[16], 0.0);
        assert_eq!(out[1], -1.0);
    }
}
