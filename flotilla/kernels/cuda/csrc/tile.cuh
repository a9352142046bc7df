// The tile GEMM for medium and large batches over the Triton layout (flotilla/kernels/triton_layout.py)
// on Hopper (sm_90a): y[m, n] = sum_k x[m, k] * W[k, n] (+ bias), the weight read in place (no second
// copy), dequantized in registers straight into the A operand of wgmma, fp32 accumulators.
//
// Orientation: the product is computed transposed, y^T = W^T x^T, so that the dequantized weight is
// wgmma's A operand (64 out-features a warpgroup, from registers: no shared-memory round trip) and a
// tile of x is its B operand (NR batch rows, from shared memory through a matrix descriptor).
//
// A block: two MMA warpgroups (256 threads), 128 out-features (64 each) x NR batch rows (64, 128, 256:
// wgmma's N). The input axis streams in stages of 64 rows: one run t of one layout block b (R = 32
// words a column, P = 16 / bits runs a block: stage s = b * P + t, input rows 64 s .. 64 s + 63).
//   * x: a ring of NS stages (NR rows x 128 bytes each, the 128-byte swizzle wgmma's descriptor
//     reads) filled by the tensor memory accelerator (one thread issues a box copy a stage, which
//     completes on the stage's "full" mbarrier; rows past M and input rows past K come zero-filled:
//     the layout's padding codes dequantize to -z * s, so x must be zero there). The copies and
//     wgmma's reads are both in the async proxy: no proxy fence, whose membar would wait for every
//     load in flight (cp.async copies, as in device run 1, measured that wait).
//   * who fills it: at 128 and 256 rows a third warpgroup, the producer (warp-specialized: it keeps
//     24 registers a thread and the MMA warps get 240 by setmaxnreg), as soon as a slot's "empty"
//     mbarrier says all 8 MMA warps released it; the MMA warps never wait for one another (the block
//     barrier a stage was 13% of the cycles at 2048 rows, round 9; measured 0-10% faster, round 10).
//     At 64 rows (two blocks an SM, no registers for a producer) thread 0 issues the copies NS - 2
//     stages ahead, and a block barrier a stage orders a slot's reuse.
//   * weights: a second ring of WNS slots, each one layout block of the block's 128 columns (a box of
//     128 columns x 32 words, 16 KB, 128-byte swizzled) by a tensor copy, up to WNS layout blocks ahead
//     (the producer's second warp at 128 and 256 rows, released on "wempty" mbarriers by every MMA
//     thread; thread 0 at 64 rows). At the start of a layout block lane (g, c) of warp w reads words
//     c + 4i (i = 0..7) of its two columns (64 wg + 16 w + g and + 8) into registers (4-byte loads
//     free of bank conflicts under the swizzle), then a proxy fence orders those reads before the
//     slot's next tensor copy. Up to round 10 each thread loaded its words from global memory one
//     block ahead (4-byte loads, half-used sectors); the ring measured up to 8% faster at W4 and
//     8-17% at W8 (round 11). The k16 step j of run t takes words 8j + c (rows 2c, 2c + 1 of the
//     step) and 8j + 4 + c (rows 2c + 8, 2c + 9), which is exactly the A fragment's order (gemv.cuh
//     PairF16 decodes a pair, times the scale).
//   * scales (and uint8 zeros) of stage s + P loaded at stage s, one layout block ahead (a stage lies in
//     one group: the group size is a multiple of 64).
// Per k16 step: wait until at most two wgmmas are in flight (the registers of the one before them
// are free), decode the next A fragment, fence, issue. A ring slot is refilled only after every wgmma
// that read it completed: at the start of stage s every warp has waited for step 4 s - 4, so stage
// s - 2's slot is free (released there, or refilled after that stage's block barrier).
// The tensor map of x is encoded on the host per launch (the driver's cuTensorMapEncodeTiled,
// fetched through the runtime) and passed as a __grid_constant__ parameter.
// Split-K (narrow grids: too few output tiles to fill the SMs): block (tile, split) runs layout blocks
// split * nb / splits .. (split + 1) * nb / splits - 1 of the input axis, writes its fp32 accumulators to
// `partial` and counts itself in on the tile's counter; the tile's last block sums the splits' partials in
// split order (deterministic), resets the counter and runs the epilogue.
// Epilogue: the accumulators (+ bias) through shared memory into 16-byte coalesced stores.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the encoder is fetched from the driver at run time)
#include <cudaTypedefs.h>

#include "gemv.cuh"

namespace flotilla::tile {

using gemv::PairF16;
using gemv::as_h2;
using gemv::h2_bits;
using gemv::static_for;
using gemv::zz_even_of;
using gemv::zz_odd_of;

struct TileParams {
  const half* x;            // [M, K] row stride lda; 16-byte aligned rows (lda % 8 == 0), K % 8 == 0
  const uint32_t* words;    // [N, KW] (R = 32 words a column a block)
  const uint16_t* scales;   // [G, N] fp16
  const uint8_t* zeros;     // [G, N] uint8, or null (zero_const for all)
  const half* bias;         // [N], or null
  half* y;                  // [M, N] row stride ldy; 16-byte aligned rows (ldy % 8 == 0), N % 8 == 0
  int M, N, K, KW, lda, ldy;
  unsigned group_magic;     // the group of stage s (64 input rows) = gemv::group_of(s, group_magic)
  int zero_const;
  int m_tiles;              // ceil(M / NR): the grid is m_tiles x splits x ceil(N / 128), batch rows fastest
  int splits;               // the input axis cut into this many ranges of whole layout blocks (split-K)
  float* partial;           // splits > 1: [splits, tiles, ACC / 4, THREADS, 4] fp32, every block's accumulators
  int* counters;            // splits > 1: [tiles], zero before the launch (the last block of a tile resets its own)
};

constexpr int WG = 2, THREADS = 128 * WG, BN = 64 * WG;  // MMA warpgroups, their threads, out-features a block
// warp-specialized blocks (128 and 256 rows): one more warpgroup in front, the producer, which only issues the tensor
// copies (of x and of the weights); its registers go to the MMA warpgroups (setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168). The block's
// pool is what it launched with, so the raise waits for ever unless ptxas gave the kernel the full 168 a thread
// (65 536 / 384, rounded down to 8): tests/test_tile.py checks the build's report
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240, WS_LAUNCH_REGS = 65536 / (THREADS + 128) / 8 * 8;
static_assert(128 * PRODUCER_REGS + THREADS * CONSUMER_REGS <= (THREADS + 128) * WS_LAUNCH_REGS,
              "the MMA warps' registers come from the producer's");
template <int NR>
constexpr bool warp_specialized() { return NR >= 128; }
constexpr int Y_STRIDE = BN + 8;                          // halves a row of the epilogue's tile
constexpr int W_SLOT = BN * 128;                          // bytes of a weight-ring slot: 32 words of BN columns

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// orders this thread's generic-proxy accesses to shared memory before later async-proxy ones (tensor copies)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// the compiler must neither read nor move an accumulator across this point
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// mbarriers (shared memory, 8 bytes each): the ring's "stage landed" signals for the tensor copies
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// the initialized barriers made visible to the async proxy (the tensor copies that complete on them)
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra WAIT;\nDONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
// a barrier of the MMA warpgroups only (named barrier 1: the producer may have exited), or of the whole block
template <bool WS>
__device__ __forceinline__ void mma_sync() {
  if constexpr (WS) asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
  else __syncthreads();
}
// a [rows x 64] box of x at (row, k) into shared memory by the tensor memory accelerator (128-byte swizzle,
// out-of-range elements zero-filled), completing on `bar`
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

// wgmma's shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart
// (the leading-dimension offset is unused in this mode: 1)
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// wgmma's operand lists: the accumulators as "+f" operands 8 at a time, their placeholders 32 at a time
#define FLOTILLA_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLOTILLA_D32(i) FLOTILLA_D8(i), FLOTILLA_D8(i + 8), FLOTILLA_D8(i + 16), FLOTILLA_D8(i + 24)
#define FLOTILLA_R0 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLOTILLA_R32 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLOTILLA_R64 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define FLOTILLA_R96 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// D[64 x N] += A[64 x 16] (registers, fp16) * B[16 x N] (shared memory, fp16), fp32 accumulators; scale-d
// is a predicate set from the last operand (1: accumulate)
__device__ __forceinline__ void wgmma_f16_n64(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" FLOTILLA_R0 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : FLOTILLA_D32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_f16_n128(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" FLOTILLA_R0 ", " FLOTILLA_R32
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : FLOTILLA_D32(0), FLOTILLA_D32(32)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_f16_n256(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" FLOTILLA_R0 ", " FLOTILLA_R32 ", " FLOTILLA_R64
      ", " FLOTILLA_R96 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : FLOTILLA_D32(0), FLOTILLA_D32(32), FLOTILLA_D32(64), FLOTILLA_D32(96)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <int NR>
__device__ __forceinline__ void wgmma_f16(float* d, const uint32_t* a, uint64_t desc) {
  if constexpr (NR == 64) wgmma_f16_n64(d, a, desc);
  else if constexpr (NR == 128) wgmma_f16_n128(d, a, desc);
  else wgmma_f16_n256(d, a, desc);
}

// run T's pair of word w as fp16 (q - z) * s, rows (2r, 2r + 1) in the low / high half
template <int BITS, int T>
__device__ __forceinline__ uint32_t decode_pair(uint32_t w, uint32_t zze, uint32_t zzo, uint32_t s2) {
  return h2_bits(__hmul2(PairF16<BITS>::template get<T>(w, w >> 8, zze, zzo), as_h2(s2)));
}

// one stage's group entries for this thread's two columns: scale (low 16 bits) and zero. Kept apart: packing them
// into one register each made every load's latency show where the two were combined (round 10)
struct GroupAt {
  uint32_t s[2], z[2];
};

// the thread's two columns of the scales (and zeros) tables; a group's entries at + group * N
struct GroupCols {
  const uint16_t *sa, *sb;
  const uint8_t *za, *zb;  // null: the zero constant
};

// stage s's entries: the group by a multiply-high (a division here was ~30 instructions a stage, round 11), its
// row offset in 32 bits (G * N < 2^32)
__device__ __forceinline__ GroupAt load_group(const TileParams& p, const GroupCols& gc, int s) {
  GroupAt g;
  const unsigned off = gemv::group_of(s, p.group_magic) * static_cast<unsigned>(p.N);
  g.s[0] = __ldg(gc.sa + off);
  g.s[1] = __ldg(gc.sb + off);
  if (gc.za != nullptr) {
    g.z[0] = __ldg(gc.za + off);
    g.z[1] = __ldg(gc.zb + off);
  } else {
    g.z[0] = g.z[1] = static_cast<uint32_t>(p.zero_const);
  }
  return g;
}

// where a block lies in the grid (batch rows fastest, then splits, then column tiles); `fresh`: from a new read of its
// index, so that nothing computed from it stays live through the main loop (that cost spills at 64 and 256 rows)
struct Place {
  int m_tile, split, n_tile;
};
__device__ __forceinline__ Place place_of(const TileParams& p, bool fresh) {
  uint32_t bid = blockIdx.x;
  if (fresh) asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(bid));
  return {static_cast<int>(bid % p.m_tiles), static_cast<int>(bid / p.m_tiles % p.splits),
          static_cast<int>(bid / (p.m_tiles * p.splits))};
}

// NR: batch rows a block (wgmma's N); NS: stages of the x ring, filled NS - 2 stages ahead of the MMAs; WNS: slots
// of the weight ring (a layout block of the block's 128 columns each, 16 KB), filled up to WNS layout blocks ahead
// (WNS - 1 at 64 rows, where a slot is refilled a block after it was read). WS
// (warp-specialized, 128 and 256 rows): a producer warpgroup issues the copies as the MMA warps release slots on
// mbarriers (its warp 0 those of x, its warp 1 those of the weights); else (64 rows, two blocks an SM: no
// registers for a producer) thread 0 issues them, a block barrier a stage ordering the reuse
template <int BITS, int NR, int NS, int WNS, bool WS = warp_specialized<NR>()>
__global__ void __launch_bounds__(WS ? THREADS + 128 : THREADS, NR <= 64 ? 2 : 1) tile_kernel(
    const TileParams p, const __grid_constant__ CUtensorMap xmap, const __grid_constant__ CUtensorMap wmap) {
  constexpr int P = 16 / BITS, R = 32, STAGE = NR * 128, AHEAD = NS - 2, ACC = NR / 2;
  static_assert(AHEAD >= 1 && WNS >= 2, "an x ring of at least 3 stages, a weight ring of at least 2 slots");
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const uint32_t wring = ring + NS * STAGE;  // 1024-byte aligned: STAGE is a multiple of 2048
  const int tid = WS ? static_cast<int>(threadIdx.x) - 128 : static_cast<int>(threadIdx.x);  // < 0: the producer
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const Place at = place_of(p, false);
  const int split = at.split, m0 = at.m_tile * NR, n0 = at.n_tile * BN;
  // the thread's first column within the block (the second is nl + 8); the producer's (warp < 0) pointers below are
  // never read through: it returns before the weights are loaded
  const int nl = 16 * warp + g;
  const int col_a = min(n0 + nl, p.N - 1), col_b = min(n0 + nl + 8, p.N - 1);  // clamped for loads
  const int nb = p.KW / R, b_begin = split * nb / p.splits, b_end = (split + 1) * nb / p.splits;
  const int s0 = b_begin * P, nstages = (b_end - b_begin) * P;  // this block's stages: s0 .. s0 + nstages - 1
  const int nblk = b_end - b_begin;                             // and layout blocks

  // the ring's barriers: local stage l (= s - s0) lands on full[l % NS], phase (l / NS) & 1; one thread issues
  // every copy (thread 0, or the producer's first). WS: the MMA warps release slot l % NS on empty[l % NS]
  // (one arrival a warp, at the start of stage l + 2) and the producer waits for that before refilling it
  // the weight ring likewise: local layout block j lands on wfull[j % WNS], phase (j / WNS) & 1; WS: every MMA
  // thread releases its slot on wempty[j % WNS] once it has read its words of block j
  __shared__ __align__(8) uint64_t full[NS], empty[WS ? NS : 1], wfull[WNS], wempty[WS ? WNS : 1];
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint32_t ebar0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty));
  const uint32_t wbar0 = static_cast<uint32_t>(__cvta_generic_to_shared(wfull));
  const uint32_t webar0 = static_cast<uint32_t>(__cvta_generic_to_shared(wempty));
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < NS; i++) mbar_init(bar0 + 8 * i, 1);
#pragma unroll
    for (int i = 0; i < WNS; i++) mbar_init(wbar0 + 8 * i, 1);
    if constexpr (WS) {
#pragma unroll
      for (int i = 0; i < NS; i++) mbar_init(ebar0 + 8 * i, THREADS / 32);
#pragma unroll
      for (int i = 0; i < WNS; i++) mbar_init(webar0 + 8 * i, THREADS);
    }
    mbar_init_fence();
  }
  __syncthreads();
  auto issue_stage = [&](int l) {  // one thread
    if (l < nstages) {
      const uint32_t bar = bar0 + 8 * (l % NS);
      mbar_expect_tx(bar, STAGE);
      tma_load_2d(ring + (l % NS) * STAGE, &xmap, 64 * (s0 + l), m0, bar);
    }
  };
  // the block's 128 columns' 32 words of layout block b_begin + j: a [128 x 128-byte] box (columns past N zero-filled),
  // 128-byte swizzled (16-byte piece i of column r at piece i ^ (r % 8): the reads below are free of bank conflicts)
  auto issue_weights = [&](int j) {  // one thread
    if (j < nblk) {
      const uint32_t bar = wbar0 + 8 * (j % WNS);
      mbar_expect_tx(bar, W_SLOT);
      tma_load_2d(wring + (j % WNS) * W_SLOT, &wmap, (b_begin + j) * R, n0, bar);
    }
  };
  if constexpr (WS) {
    if (tid < 0) {  // the producer warpgroup: its warp 0 fills the x ring, its warp 1 the weight ring, as slots come free
      setmaxnreg_dec<PRODUCER_REGS>();
      if (threadIdx.x == 0) {
        for (int l = 0; l < nstages; l++) {
          if (l >= NS) mbar_wait(ebar0 + 8 * (l % NS), (l / NS - 1) & 1);  // stage l - NS's slot released
          issue_stage(l);
        }
      } else if (threadIdx.x == 32) {
        for (int j = 0; j < nblk; j++) {
          if (j >= WNS) mbar_wait(webar0 + 8 * (j % WNS), (j / WNS - 1) & 1);  // block j - WNS's slot read
          issue_weights(j);
        }
      }
      return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
  }
  // this thread's words of a weight slot: word c + 4 i of column nl + 8 h sits in 16-byte piece i ^ (nl % 8) = i ^ g
  const uint32_t wmine = wring + nl * 128 + 4 * c;

  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; i++) acc[i] = 0.f;
  if (!WS && tid == 0) {
#pragma unroll
    for (int j = 0; j < WNS; j++) issue_weights(j);
#pragma unroll
    for (int s = 0; s < AHEAD; s++) issue_stage(s);
  }
  // the group entries of the P stages of the next layout block, loaded one block ahead (a stage ahead was
  // not enough: the load's latency showed in every stage on the narrow weights, device run 2)
  const GroupCols gc = {p.scales + col_a, p.scales + col_b, p.zeros != nullptr ? p.zeros + col_a : nullptr,
                        p.zeros != nullptr ? p.zeros + col_b : nullptr};
  GroupAt gq[P];
#pragma unroll
  for (int t = 0; t < P; t++) gq[t] = load_group(p, gc, s0 + t);

  for (int b = b_begin; b < b_end; b++) {
    const int jb = b - b_begin;  // the local layout block
    uint32_t wcur[2][8];
    {  // this layout block's words out of its slot (landed), then the slot released
      const uint32_t slot = wmine + (jb % WNS) * W_SLOT;
      mbar_wait(wbar0 + 8 * (jb % WNS), (jb / WNS) & 1);
#pragma unroll
      for (int i = 0; i < 8; i++) {
        wcur[0][i] = lds32(slot + ((i ^ g) << 4));
        wcur[1][i] = lds32(slot + 8 * 128 + ((i ^ g) << 4));
      }
      // the slot's next contents come by a tensor copy (the async proxy): this thread's reads of it (the generic
      // proxy) ordered before that write. Without the fence the W8 kernels at 256 rows gave a different result in
      // up to 10 of 40 calls on an H100 (bench/NOTES-kernels.md round 11)
      fence_proxy_async();
      if constexpr (WS) mbar_arrive(webar0 + 8 * (jb % WNS));  // else the next stage's block barrier orders it
    }
    static_for<P>([&](auto tc) {
      constexpr int t = decltype(tc)::value;
      const int s = b * P + t, l = s - s0;
      const GroupAt gcur = gq[t];
      uint32_t zze[2], zzo[2], s2[2];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        zze[h] = zz_even_of(gcur.z[h] * 0x00010001u);
        zzo[h] = zz_odd_of(gcur.z[h] * 0x00010001u);
        s2[h] = gcur.s[h] * 0x00010001u;
      }
      if constexpr (WS) {
        // every wgmma of stage s - 2 completed (this warp waited for step 4 s - 4): its slot is free
        if (lane == 0 && l >= 2) mbar_arrive(ebar0 + 8 * ((l - 2) % NS));
        mbar_wait(bar0 + 8 * (l % NS), (l / NS) & 1);  // stage s has landed
      } else {
        mbar_wait(bar0 + 8 * (l % NS), (l / NS) & 1);  // stage s has landed
        __syncthreads();  // and every wgmma of stage s - 2 completed (each thread waited for step 4 s - 4)
        if (tid == 0) {
          issue_stage(l + AHEAD);  // into stage s - 2's slot
          // every thread read layout block jb - 1's words before this barrier: its slot takes block jb - 1 + WNS
          if (t == 0 && jb >= 1) issue_weights(jb - 1 + WNS);
        }
      }
      if (l + P < nstages) gq[t] = load_group(p, gc, s + P);
      const uint32_t slot = ring + (l % NS) * STAGE;
      static_for<4>([&](auto jc) {
        constexpr int j = decltype(jc)::value;
        uint32_t a[4];
        wgmma_wait<2>();  // at most the two steps before in flight: the one before those has read its A
        a[0] = decode_pair<BITS, t>(wcur[0][2 * j], zze[0], zzo[0], s2[0]);
        a[1] = decode_pair<BITS, t>(wcur[1][2 * j], zze[1], zzo[1], s2[1]);
        a[2] = decode_pair<BITS, t>(wcur[0][2 * j + 1], zze[0], zzo[0], s2[0]);
        a[3] = decode_pair<BITS, t>(wcur[1][2 * j + 1], zze[1], zzo[1], s2[1]);
        wgmma_fence();
        wgmma_f16<NR>(acc, a, desc_sw128(slot + 32 * j));
        wgmma_commit();
      });
    });
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < ACC; i++) fence_operand(acc[i]);

  if (p.splits > 1) {  // split-K: this block's partial out, and the tile's last block sums them all
    const Place pl = place_of(p, true);
    const int tile_id = pl.n_tile * p.m_tiles + pl.m_tile, tiles = p.m_tiles * ((p.N + BN - 1) / BN);
    float4* mine =
        reinterpret_cast<float4*>(p.partial) + (static_cast<size_t>(pl.split) * tiles + tile_id) * (ACC / 4) * THREADS;
#pragma unroll
    for (int q = 0; q < ACC / 4; q++)
      __stcg(mine + q * THREADS + tid, make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
    mma_sync<WS>();  // every thread's partial stored, ordered before thread 0's fence (CTA barrier)
    __shared__ int is_last;
    if (tid == 0) {  // one thread fences for the block (a fence in every thread measured as membar stalls)
      __threadfence();  // release: the block's partial before its count
      is_last = atomicAdd(p.counters + tile_id, 1) == p.splits - 1;
      if (is_last) __threadfence();  // acquire: the other splits' partials after their counts
    }
    mma_sync<WS>();
    if (!is_last) return;  // block-uniform
    // split by split, each round's loads all issued before its adds (one latency a split, not one a load)
    const float4* part = reinterpret_cast<const float4*>(p.partial) + static_cast<size_t>(tile_id) * (ACC / 4) * THREADS;
#pragma unroll
    for (int q = 0; q < ACC / 4; q++) {
      const float4 v = __ldcg(part + q * THREADS + tid);
      acc[4 * q] = v.x, acc[4 * q + 1] = v.y, acc[4 * q + 2] = v.z, acc[4 * q + 3] = v.w;
    }
    for (int j = 1; j < p.splits; j++) {  // in split order: the same sum whichever block came last
      part += static_cast<size_t>(tiles) * (ACC / 4) * THREADS;
#pragma unroll
      for (int q = 0; q < ACC / 4; q++) {
        const float4 v = __ldcg(part + q * THREADS + tid);
        acc[4 * q] += v.x, acc[4 * q + 1] += v.y, acc[4 * q + 2] += v.z, acc[4 * q + 3] += v.w;
      }
    }
    if (tid == 0) p.counters[tile_id] = 0;  // ready for the next launch
  }

  // epilogue: + bias, to fp16, through shared memory (the ring, now free: every copy landed) into rows of y
  mma_sync<WS>();
  half* ys = reinterpret_cast<half*>(smem_raw + (ring - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw))));
  const Place pe = place_of(p, true);
  const int me = pe.m_tile * NR, ne = pe.n_tile * BN;
  float bias[2] = {0.f, 0.f};
  if (p.bias != nullptr) {
    bias[0] = __half2float(p.bias[min(ne + nl, p.N - 1)]);
    bias[1] = __half2float(p.bias[min(ne + nl + 8, p.N - 1)]);
  }
#pragma unroll
  for (int i = 0; i < ACC; i++) {
    const int row = 8 * (i / 4) + 2 * c + (i & 1), h = (i >> 1) & 1;
    ys[row * Y_STRIDE + nl + 8 * h] = __float2half_rn(acc[i] + bias[h]);
  }
  mma_sync<WS>();
#pragma unroll
  for (int i = 0; i < NR * (BN / 8) / THREADS; i++) {
    const int idx = tid + i * THREADS, row = idx / (BN / 8), ch = idx % (BN / 8);
    const int m = me + row, n = ne + 8 * ch;
    if (m < p.M && n < p.N)
      *reinterpret_cast<uint4*>(p.y + static_cast<size_t>(m) * p.ldy + n) =
          *reinterpret_cast<const uint4*>(ys + row * Y_STRIDE + 8 * ch);
  }
}

// shared memory a block: the x ring, the weight ring, 1024 bytes of alignment slack (the epilogue's tile fits the
// x ring)
template <int NR, int NS, int WNS>
constexpr int tile_smem_bytes() {
  static_assert(NR * Y_STRIDE * 2 <= NS * NR * 128, "the epilogue's tile fits in the ring");
  // with up to 256 bytes of static barriers: within sm_90's 227 KB a block, or half an SM's 228 KB less the 1 KB the
  // system keeps a block where two blocks share an SM
  static_assert(NS * NR * 128 + WNS * W_SLOT + 1024 + 256 <= (NR <= 64 ? 228 * 1024 / 2 - 1024 : 227 * 1024),
                "the rings fit the shared memory a block may have");
  return NS * NR * 128 + WNS * W_SLOT + 1024;
}

// the driver's tensor-map encoder (cuTensorMapEncodeTiled), fetched once through the runtime; null where
// the driver lacks it
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
#else  // 12.0 - 12.4: the only form there (deprecated since)
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// x [M, K] (row stride lda) as boxes of NR rows x 64 columns, 128-byte swizzled, zero past M and K
template <int NR>
cudaError_t x_tensor_map(const TileParams& p, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.K), static_cast<cuuint64_t>(p.M)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.lda) * sizeof(half)};
  const cuuint32_t box[2] = {64, NR}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<half*>(p.x), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// the words [N, KW] as boxes of BN columns x 32 words (a layout block of a block's columns), 128-byte swizzled,
// zero past N; the rows (KW words) 16-byte aligned and the base too (tile.py checks both)
inline cudaError_t w_tensor_map(const TileParams& p, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.KW), static_cast<cuuint64_t>(p.N)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.KW) * sizeof(uint32_t)};
  const cuuint32_t box[2] = {32, BN}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<uint32_t*>(p.words), dims, strides, box,
                            elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int BITS, int NR, int NS, int WNS>
cudaError_t tile_launch(const TileParams& p, cudaStream_t stream) {
  constexpr bool WS = warp_specialized<NR>();
  constexpr int smem = tile_smem_bytes<NR, NS, WNS>();
  // the opt-in to more than 48 KB of dynamic shared memory, once per device (an attribute of the device's
  // context: pipeline stages on several GPUs of one process each need it)
  static uint64_t configured = 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const uint64_t bit = 1ull << (device & 63);
  if (!(__atomic_load_n(&configured, __ATOMIC_ACQUIRE) & bit)) {
    e = cudaFuncSetAttribute(tile_kernel<BITS, NR, NS, WNS, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    __atomic_fetch_or(&configured, bit, __ATOMIC_RELEASE);
  }
  CUtensorMap xmap, wmap;
  e = x_tensor_map<NR>(p, &xmap);
  if (e == cudaSuccess) e = w_tensor_map(p, &wmap);
  if (e != cudaSuccess) return e;
  const int n_tiles = (p.N + BN - 1) / BN;
  if (p.splits < 1 || (p.splits > 1 && (p.partial == nullptr || p.counters == nullptr))) return cudaErrorInvalidValue;
  tile_kernel<BITS, NR, NS, WNS, WS>
      <<<p.m_tiles * n_tiles * p.splits, WS ? THREADS + 128 : THREADS, smem, stream>>>(p, xmap, wmap);
  return cudaGetLastError();
}

// the instances: NR batch rows a block with its x ring's and weight ring's depths (deeper x rings, 12 / 9 / 6 stages,
// measured no faster: bench/NOTES-kernels.md round 8). Blocks of 64 rows run two an SM (at most ~113 KB each)
#define FLOTILLA_TILE_INSTANCES(X, BITS) X(BITS, 64, 5, 4) X(BITS, 128, 5, 4) X(BITS, 256, 5, 4)
#define FLOTILLA_TILE_INSTANCE(BITS, NR, NS, WNS) \
  template cudaError_t tile_launch<BITS, NR, NS, WNS>(const TileParams&, cudaStream_t);
#define FLOTILLA_TILE_EXTERN(BITS, NR, NS, WNS) \
  extern template cudaError_t tile_launch<BITS, NR, NS, WNS>(const TileParams&, cudaStream_t);
#define FLOTILLA_TILE_INSTANTIATE(BITS) FLOTILLA_TILE_INSTANCES(FLOTILLA_TILE_INSTANCE, BITS)
#define FLOTILLA_TILE_DECLARE(BITS) FLOTILLA_TILE_INSTANCES(FLOTILLA_TILE_EXTERN, BITS)

}  // namespace flotilla::tile
