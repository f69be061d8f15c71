// One launch copies every span of a batch (kvxferd/cuda/spancopy.py, issue #37).
//
// The host splits the spans into chunks of at most CHUNK_BYTES (a multiple of 16, so a chunk is as aligned
// as its span) and uploads one table of 3 x num_chunks uint64: destinations, then sources, then sizes.
// Each block copies whole chunks, striding over them by the grid size; its threads copy the widest word
// that both addresses allow (16, 8 or 4 bytes, else single bytes) and the size's remainder byte by byte.
// Spans must not overlap one another (as with memcpy); their order of copying is unspecified.
//
// PTX: kvxferd/cuda/spancopy_ptx.py (its docstring has the command that regenerates it from this file).
// No headers: NVRTC compiles it as is, for the virtual architecture compute_70 (the driver JITs that PTX
// for the GPU it runs on, sm_90 and newer included).

#define THREADS_PER_BLOCK 256  // spancopy.py's THREADS_PER_BLOCK: launches use exactly this block size

typedef unsigned long long u64;

struct __align__(16) Word16 {  // a 16-byte load or store (ld.global.v2.u64) where both ends are 16-aligned
    u64 low, high;
};

// Copy num_bytes from src to dst with this block's threads, in words of Word where both are aligned to it.
template <typename Word>
__device__ __forceinline__ void copy_chunk(unsigned char* dst, const unsigned char* src, u64 num_bytes) {
    Word* dst_words = reinterpret_cast<Word*>(dst);
    const Word* src_words = reinterpret_cast<const Word*>(src);
    const u64 num_words = num_bytes / sizeof(Word);
    const u64 stride = blockDim.x;
    u64 i = threadIdx.x;
    // Four loads before their stores: each thread keeps four reads in flight rather than one, which a
    // memory-bound copy needs to reach full bandwidth with few chunks per SM.
    for (; i + 3 * stride < num_words; i += 4 * stride) {
        const Word a = src_words[i];
        const Word b = src_words[i + stride];
        const Word c = src_words[i + 2 * stride];
        const Word d = src_words[i + 3 * stride];
        dst_words[i] = a;
        dst_words[i + stride] = b;
        dst_words[i + 2 * stride] = c;
        dst_words[i + 3 * stride] = d;
    }
    for (; i < num_words; i += stride) {
        dst_words[i] = src_words[i];
    }
    for (u64 j = num_words * sizeof(Word) + threadIdx.x; j < num_bytes; j += stride) {
        dst[j] = src[j];  // the size's remainder past the last whole word
    }
}

// table: dsts[num_chunks], srcs[num_chunks], sizes[num_chunks] (device memory, uint64 each).
extern "C" __global__ void __launch_bounds__(THREADS_PER_BLOCK)
kvx_span_copy(const u64* __restrict__ table, u64 num_chunks) {
    for (u64 chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
        const u64 dst = table[chunk];
        const u64 src = table[num_chunks + chunk];
        const u64 num_bytes = table[2 * num_chunks + chunk];
        const u64 both = dst | src;  // spancopy.py's word_bytes mirrors this choice
        unsigned char* to = reinterpret_cast<unsigned char*>(dst);
        const unsigned char* from = reinterpret_cast<const unsigned char*>(src);
        if ((both & 15) == 0) {
            copy_chunk<Word16>(to, from, num_bytes);
        } else if ((both & 7) == 0) {
            copy_chunk<u64>(to, from, num_bytes);
        } else if ((both & 3) == 0) {
            copy_chunk<unsigned int>(to, from, num_bytes);
        } else {
            copy_chunk<unsigned char>(to, from, num_bytes);
        }
    }
}
