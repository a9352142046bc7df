// The GEMV's tensor-core plan (fp16 activations, GPTQ layouts: zeros constant or uint8, and the GGUF
// forms' float offsets at R = 16; M <= 8; R = 16 or 32 words a block): the same Triton layout, the
// products on mma.sync, so that a pair of weights costs one LOP3 and one HADD2 / HFMA2 (+ a shift a
// word for runs 2, 3) on the CUDA cores.
//
// A warp computes 16 output columns (the MMA's rows) for all M <= 8 batch rows (its 8 columns).
// Per strip of 16 words of each column, lane (g, t) = (lane / 4, lane % 4) loads words 4t..4t+3
// of columns g and g + 8 (16 bytes each), i.e. the (2r, 2r+1) row pairs of every run of them, and
// x of batch row g at those rows (one 16-byte load a run). The MMA's k order is chosen so that
// these are its fragments: for run s and half h, k-slot t holds word 2h, slot t + 4 word 2h + 1.
// The A operand is q - z, exact in fp16: the CUDA-core plan's pair decode (gemv.cuh PairF16: (w &
// mask) | 0x6400 = 1024 + q, plus -(1024 + z); odd runs at 4 bits 1024 + 16 q, times 1 / 16 plus
// -(64 + z)). (Until device run 3 of bench/NOTES-kernels.md, "GEMV, round 3", the raw 1024 + q went
// into the MMA and a second MMA with -(1024 + z) as A removed the offset: one LOP3 a pair, but
// twice the MMAs; this decode measured 3-9% faster.) Each group of a block and run parity has its
// own accumulator, times its scale into the output fragment when the warp leaves the block; a warp
// takes whole blocks (blocks warp, warp + warps, ...).
//
// Float offsets (mode OFF: GGUF Q4_1, Q4_K, Q5_1, Q5_K, w = s q + m, one run a group): the A operand is
// q (zero constant 0), and sum_k w_k x_k = s sum_k q_k x_k + m sum_k x_k, so each group also has
// an accumulator of the sum of x over its rows, one more mma.sync a run and half with A = 1.0 (no
// decode); the epilogue adds the group's offset times it. The weight is never rounded to fp16 (the
// Triton kernel and the CUDA-core plan round s q + m once): closer to the exact sum, not bit-equal.
//
// How a warp streams its blocks (p.stages): 0, a register double buffer (the next block's 16-byte
// loads issued before this block is decoded; x, scales and zeros read from global memory in the
// block); S >= 2, a ring of S block slots a warp in shared memory filled by cp.async, S - 1 blocks
// ahead of the one decoded: the weights (16 bytes a lane, L2 evict-first), the lane's scale (zero)
// words and x of the block's rows all ride in the slot, so that no global load sits in a warp's
// chain behind its own prefetch (with x read from global memory in the block, the ring measured
// up to 2x slower than the double buffer: bench/NOTES-kernels.md, GEMV device run 3).
//
// Programmatic dependent launch (sm_90+, p.pdl): the kernel may start while the kernel before it
// (the norm, silu * up or attention that writes x) still runs. Only x depends on that kernel, so a
// warp issues its first weight loads (register plan: its first block; ring: all S slots' weights,
// scales and zeros) before griddepcontrol.wait, and x's after; it lets the kernel after it launch
// (griddepcontrol.launch_dependents) once its weight stream is done. Without PDL both are no-ops.
#pragma once
#include "gemv.cuh"

namespace flotilla::gemv {

__device__ __forceinline__ void mma_f16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the pair decode's zero constant for run parity PARITY (z < 64): packed -(1024 + z), or -(64 + z)
// for the odd runs at 4 bits (PairF16<4>)
template <int BITS, int PARITY>
__device__ __forceinline__ uint32_t zero_const_of(uint32_t z) {
  if constexpr (BITS == 4 && PARITY) return zz_odd_of(z * 0x00010001u);
  else return zz_even_of(z * 0x00010001u);
}

// wait until the grids this one depends on programmatically have completed and their writes are
// visible (at once when launched without PDL). No "memory" clobber: every read of x is itself a
// volatile asm (load_x, cp.async), which the compiler keeps after this one, while the constant
// tables' loads (scales, zeros: __ldg) may still be hoisted above it
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n");
#endif
}
// let the next kernel of the stream launch (if launched as a programmatic dependent) before this one ends
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// a value an earlier kernel of the stream wrote: a volatile load, so that the compiler keeps it after
// grid_dependency_wait (which has no memory clobber)
__device__ __forceinline__ half load_after_wait(const half* p) {
  unsigned short u;
  asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(u) : "l"(p));
  return __ushort_as_half(u);
}

constexpr int MMA_COLS = 16;
constexpr int MAX_STAGES = 8;
// the consumer's partial sums (M x n_partials floats) copied into shared memory where they fit
constexpr int MMA_PARTIALS_SMEM = 1024;

// 16 bytes global -> shared, bypassing L1, first out of L2; one commit group per ring step
__device__ __forceinline__ void cp_async16(unsigned smem, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(src), "l"(policy)
               : "memory");
}
// x: 16 bytes global -> shared, bypassing L1 (read by every warp of the GPU: L2's default policy)
__device__ __forceinline__ void cp_async16_l2(unsigned smem, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(unsigned smem, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// wait until at most n (0..MAX_STAGES - 1, uniform across the warp) groups are pending
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

// bytes of one batch row of x in a ring slot: the block's 2 R P input rows in fp16, + 64 so that
// batch rows g and g + 1 (one quarter warp of 16-byte reads) fall in different banks
template <int BITS, int LOG2R>
__host__ __device__ constexpr int mma_x_row_bytes() { return 2 * 2 * (1 << LOG2R) * (16 / BITS) + 64; }

// the ring's slot of one block a warp: its 16 columns' words (SPB strips of 16 words, 16 bytes a
// lane and column half) and a lane's 4-byte words of the scales (and zeros) of its groups, 2 each;
// (or offsets); then M rows of x of mma_x_row_bytes each
template <int BITS, int MODE, int TPG, int LOG2R>
__host__ __device__ constexpr int mma_slot_bytes() {
  return 32 * ((1 << LOG2R) / 16 * 2 * 16 + (16 / BITS / TPG) * 2 * (MODE == SYM ? 1 : 2) * 4);
}

// grid: N / 16 blocks of 32 * warps threads; the warps split the layout's blocks of the input axis
// RING: the weight stream through the shared-memory ring of p.stages slots a warp, else the
// register double buffer
// FUSE: the residual and norm fusion's instance (GemvParams resid / n_partials; cuda/gemv.py
// NormedResidual); without it the kernel has none of the fusion's shared memory, registers or code
template <int BITS, int MODE, int TPG, int LOG2R, bool RING, bool FUSE>
__global__ void __launch_bounds__(32 * MAX_WARPS) gemv_mma_kernel(const GemvParams p) {
  constexpr int P = 16 / BITS, NG = P / TPG, R = 1 << LOG2R, SPB = R / 16;  // SPB: strips of 16 words a block
  constexpr int PAR = BITS == 4 ? 2 : 1;  // run parities with their own zero constant and scale
  constexpr int BK = 2 * R * P;           // input rows a block
  constexpr int slot_fixed = mma_slot_bytes<BITS, MODE, TPG, LOG2R>(), X_ROW = mma_x_row_bytes<BITS, LOG2R>();
  static_assert(SPB >= 1 && NG >= 1, "a block of at least 16 words, whole groups of runs");
  __shared__ float red[MAX_WARPS][MMA_COLS][8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // the block's columns: n0..n0+7 (lane rows g) and n0 + hi..n0 + hi + 7 (g + 8): 16 consecutive, or
  // under silu_half 8 of gate and the same 8 of up
  const int hi = p.silu_half ? p.silu_half : 8;
  const int n0 = blockIdx.x * (p.silu_half ? 8 : MMA_COLS);
  const int nblocks = p.KW >> LOG2R;
  // lane (g, t): 16 bytes of strip q of block b of column g at wa + b * R / 4 + 4q (uint4 units)
  const uint4* wa = pinned(reinterpret_cast<const uint4*>(p.words + static_cast<size_t>(n0 + g) * p.KW) + t);
  const uint4* wb = pinned(reinterpret_cast<const uint4*>(p.words + static_cast<size_t>(n0 + g + hi) * p.KW) + t);
  // batch row g (rows past M repeat the last: their outputs are never stored); run s of strip q of
  // block b: rows b * BK + s * 2R + 32q + 8t .. + 8
  const half* xg = pinned(static_cast<const half*>(p.x) + static_cast<size_t>(min(g, p.M - 1)) * p.lda + 8 * t);
  const uint16_t* sc = pinned(p.scales + n0 + g);
  const uint8_t* zp = MODE == ZP ? pinned(p.zeros + n0 + g) : nullptr;
  const uint16_t* of = MODE == OFF ? pinned(p.offsets + n0 + g) : nullptr;
  const uint64_t policy = evict_first_policy();
  uint32_t zk[NG][PAR][2];  // zero constants of the block's groups (per parity), columns g and g + 8
#pragma unroll
  for (int q = 0; q < NG; q++) {
    zk[q][0][0] = zk[q][0][1] = zero_const_of<BITS, 0>(p.zero_const);
    if constexpr (PAR == 2) zk[q][PAR - 1][0] = zk[q][PAR - 1][1] = zero_const_of<BITS, 1>(p.zero_const);
  }
  float y[4] = {0.f, 0.f, 0.f, 0.f};
  // The residual and norm fusion's reads of what the kernels before wrote, issued right after the
  // grid dependency wait and consumed only in the epilogue, so that their latency hides behind the
  // weight stream instead of adding to the block's chain: the consumer's partial sums (cp.async into
  // shared memory where they fit, read from global memory in the epilogue where not), the producer's
  // residual and norm weight at the entries this thread stores (registers).
  __shared__ __align__(16) float part_s[FUSE ? MMA_PARTIALS_SMEM : 4];
  __shared__ float rstd[8];
  const bool part_in_smem = FUSE && p.n_partials > 0 && p.M * p.n_partials <= MMA_PARTIALS_SMEM && p.n_partials % 4 == 0;
  constexpr int EPI = MMA_COLS * 8 / 32;  // epilogue entries a thread, at most (one warp a block)
  half rv[FUSE ? EPI : 1], gv[FUSE ? EPI : 1];
  auto fusion_loads = [&]() {  // the partials' copies join the caller's next cp.async commit group
    if constexpr (!FUSE) return;
    if (part_in_smem) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(part_s));
      for (int j = threadIdx.x; j < p.M * p.n_partials / 4; j += blockDim.x)
        cp_async16_l2(dst + 16 * j, p.partials + 4 * j);
    }
    if constexpr (FUSE) {
      if (p.resid == nullptr || p.silu_half) return;
#pragma unroll
      for (int i = 0; i < EPI; i++) {
        const int e = threadIdx.x + i * blockDim.x, c = e / 8, m = e % 8;
        if (e < MMA_COLS * 8 && m < p.M) {
          rv[i] = load_after_wait(static_cast<const half*>(p.resid) + static_cast<size_t>(m) * p.ldr + n0 + c);
          gv[i] = static_cast<const half*>(p.gamma)[n0 + c];
        }
      }
    }
  };
  auto norm_rstd = [&]() {  // warp 0, in the epilogue: rstd of each batch row, the partials in a fixed order
    if (warp != 0) return;
    for (int m = 0; m < p.M; m++) {
      const int np = p.n_partials;
      const float* pm = part_in_smem ? part_s + m * np : p.partials + static_cast<size_t>(m) * np;
      float s = 0.f;
#pragma unroll 8
      for (int j = lane; j < np; j += 32) s += pm[j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
      if (lane == 0) rstd[m] = p.post_scale * rsqrtf(fmaf(s, p.inv_k, p.eps));
    }
  };

  auto load = [&](uint4 (*dst)[2], int b) {
#pragma unroll
    for (int q = 0; q < SPB; q++) {
      dst[q][0] = load_stream(wa + b * (R / 4) + 4 * q, policy);
      dst[q][1] = load_stream(wb + b * (R / 4) + 4 * q, policy);
    }
  };
  // tab (the ring only): this lane's entries of the block's slot, tab[e * 32]: e = 2q + c the 32-bit
  // word of scales row group q holding column g + 8c (half g % 2), e = 2 NG + 2q + c that of zeros
  // (byte g % 4), or of offsets (half g % 2); xs (the ring only): x of the block's rows of batch row
  // g in the slot (global memory without the ring); without the ring they are read here
  auto block = [&](const uint4 (*cur)[2], int b, const uint32_t* tab, const char* xs) {
    const int u0 = b * P;
    unsigned grp[NG];
#pragma unroll
    for (int q = 0; q < NG; q++) grp[q] = group_of(u0 + q * TPG, p.group_magic);
    if constexpr (MODE == ZP) {
#pragma unroll
      for (int q = 0; q < NG; q++) {
        uint32_t z0, z1;
        if constexpr (RING) {
          z0 = (tab[(2 * NG + 2 * q) * 32] >> 8 * (g & 3)) & 0xFF, z1 = (tab[(2 * NG + 2 * q + 1) * 32] >> 8 * (g & 3)) & 0xFF;
        } else {
          const uint8_t* zr = zp + grp[q] * static_cast<unsigned>(p.N);
          z0 = __ldg(zr), z1 = __ldg(zr + hi);
        }
        zk[q][0][0] = zero_const_of<BITS, 0>(z0), zk[q][0][1] = zero_const_of<BITS, 0>(z1);
        if constexpr (PAR == 2)
          zk[q][PAR - 1][0] = zero_const_of<BITS, 1>(z0), zk[q][PAR - 1][1] = zero_const_of<BITS, 1>(z1);
      }
    }
    float acc[NG][PAR][4];
    float accx[MODE == OFF ? NG : 1][4];  // OFF: each group's sum of x (fragment columns 2t, 2t + 1)
#pragma unroll
    for (int q = 0; q < NG; q++) {
#pragma unroll
      for (int v = 0; v < PAR; v++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[q][v][e] = 0.f;
      if constexpr (MODE == OFF)
#pragma unroll
        for (int e = 0; e < 4; e++) accx[q][e] = 0.f;
    }
    const half* xb = xg + static_cast<size_t>(b) * BK;
#pragma unroll
    for (int sq = 0; sq < SPB; sq++) {
      const uint32_t a[4] = {cur[sq][0].x, cur[sq][0].y, cur[sq][0].z, cur[sq][0].w};
      const uint32_t bw[4] = {cur[sq][1].x, cur[sq][1].y, cur[sq][1].z, cur[sq][1].w};
      uint32_t a8[4], b8[4];
#pragma unroll
      for (int k = 0; k < 4; k++) a8[k] = a[k] >> 8, b8[k] = bw[k] >> 8;
      static_for<P>([&](auto sc_) {
        constexpr int s = decltype(sc_)::value;
        constexpr int q = s / TPG, v = s % PAR;
        uint4 xv;
        if constexpr (RING) xv = *reinterpret_cast<const uint4*>(xs + 2 * (s * 2 * R + 32 * sq + 8 * t));
        else xv = load_x(xb + s * 2 * R + 32 * sq);
        const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int h = 0; h < 2; h++) {  // q - z of column g (a) and g + 8 (bw)
          using D = PairF16<BITS>;
          const uint32_t* ze = zk[q][0];
          const uint32_t* zo = zk[q][PAR - 1];
          mma_f16(acc[q][v], h2_bits(D::template get<s>(a[2 * h], a8[2 * h], ze[0], zo[0])),
                  h2_bits(D::template get<s>(bw[2 * h], b8[2 * h], ze[1], zo[1])),
                  h2_bits(D::template get<s>(a[2 * h + 1], a8[2 * h + 1], ze[0], zo[0])),
                  h2_bits(D::template get<s>(bw[2 * h + 1], b8[2 * h + 1], ze[1], zo[1])), xs[2 * h], xs[2 * h + 1]);
          if constexpr (MODE == OFF) {  // A = 1.0: the sum of x over these rows
            constexpr uint32_t one = 0x3C003C00u;
            mma_f16(accx[q], one, one, one, one, xs[2 * h], xs[2 * h + 1]);
          }
        }
      });
    }
    // each group's sums times its scale (/ 16 for the odd runs' 16 (q - z)) into the output fragment
#pragma unroll
    for (int q = 0; q < NG; q++) {
      float s0, s1;
      if constexpr (RING) {
        const int sh = 16 * (g & 1);
        s0 = __half2float(__ushort_as_half(static_cast<unsigned short>(tab[2 * q * 32] >> sh)));
        s1 = __half2float(__ushort_as_half(static_cast<unsigned short>(tab[(2 * q + 1) * 32] >> sh)));
      } else {
        const uint16_t* sr = sc + grp[q] * static_cast<unsigned>(p.N);
        s0 = __half2float(__ushort_as_half(__ldg(sr))), s1 = __half2float(__ushort_as_half(__ldg(sr + hi)));
      }
#pragma unroll
      for (int v = 0; v < PAR; v++) {
        if (TPG == 1 && v != q % PAR) continue;  // a group of one run has one parity
        y[0] = fmaf(s0, acc[q][v][0], y[0]), y[1] = fmaf(s0, acc[q][v][1], y[1]);
        y[2] = fmaf(s1, acc[q][v][2], y[2]), y[3] = fmaf(s1, acc[q][v][3], y[3]);
      }
      if constexpr (MODE == OFF) {  // the offsets times the group's sums of x
        float m0, m1;
        if constexpr (RING) {
          const int sh = 16 * (g & 1);
          m0 = __half2float(__ushort_as_half(static_cast<unsigned short>(tab[(2 * NG + 2 * q) * 32] >> sh)));
          m1 = __half2float(__ushort_as_half(static_cast<unsigned short>(tab[(2 * NG + 2 * q + 1) * 32] >> sh)));
        } else {
          const uint16_t* mr = of + grp[q] * static_cast<unsigned>(p.N);
          m0 = __half2float(__ushort_as_half(__ldg(mr))), m1 = __half2float(__ushort_as_half(__ldg(mr + hi)));
        }
        y[0] = fmaf(m0, accx[q][0], y[0]), y[1] = fmaf(m0, accx[q][1], y[1]);
        y[2] = fmaf(m1, accx[q][2], y[2]), y[3] = fmaf(m1, accx[q][3], y[3]);
      }
    }
  };
  if constexpr (RING) {
    // slot j of this warp: SPB * 2 rows of 32 uint4, [q][h] the 16 bytes lane l copied of strip q of
    // column g + 8h; TAB rows of 32 words, the scale (and zero) words of block() above; then x of
    // the block's BK input rows for each batch row m < M (rows X_ROW bytes apart: padded so that
    // the 8 lanes of a quarter warp, two batch rows, hit distinct banks). Lanes copy x pieces for
    // one another: __syncwarp after the wait and before a slot is refilled.
    extern __shared__ uint4 ring_smem[];
    const int S = p.stages, mx = min(p.M, 8);
    const int slot_bytes = slot_fixed + mx * X_ROW;
    char* slots = reinterpret_cast<char*>(ring_smem) + static_cast<size_t>(warp) * S * slot_bytes;
    const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(slots));
    const unsigned slots_s = ring_s + 16 * lane, tab_s = ring_s + SPB * 2 * 32 * 16 + 4 * lane;
    // this lane's 4-byte words of the tables: scales (offsets) at columns (n0 + g) & ~1, zeros (n0 + g) & ~3
    const uint16_t* sc_w = p.scales + ((n0 + g) & ~1);
    const uint8_t* zp_w = MODE == ZP ? p.zeros + ((n0 + g) & ~3) : nullptr;
    const uint16_t* of_w = MODE == OFF ? p.offsets + ((n0 + g) & ~1) : nullptr;
    const half* x0 = static_cast<const half*>(p.x);
    const int nb = warp < nblocks ? (nblocks - 1 - warp) / warps + 1 : 0;  // this warp's blocks
    auto issue_weights = [&](int slot, int b) {  // the block's words, scales (zeros, offsets): no dependency
      const unsigned base = slot * slot_bytes;
#pragma unroll
      for (int q = 0; q < SPB; q++) {
        cp_async16(slots_s + base + (q * 2 + 0) * 32 * 16, wa + b * (R / 4) + 4 * q, policy);
        cp_async16(slots_s + base + (q * 2 + 1) * 32 * 16, wb + b * (R / 4) + 4 * q, policy);
      }
#pragma unroll
      for (int q = 0; q < NG; q++) {
        const unsigned row = group_of(b * P + q * TPG, p.group_magic) * static_cast<unsigned>(p.N);
#pragma unroll
        for (int c = 0; c < 2; c++) {
          cp_async4(tab_s + base + (2 * q + c) * 32 * 4, sc_w + row + hi * c);
          if constexpr (MODE == ZP) cp_async4(tab_s + base + (2 * NG + 2 * q + c) * 32 * 4, zp_w + row + hi * c);
          if constexpr (MODE == OFF) cp_async4(tab_s + base + (2 * NG + 2 * q + c) * 32 * 4, of_w + row + hi * c);
        }
      }
    };
    auto issue_x = [&](int slot, int b) {  // x of the block's rows: written by the kernel before this one
      const unsigned base = slot * slot_bytes;
      // x: piece j (8 halves) of the block's rows, batch row j / (BK / 8)
      for (int j = lane; j < mx * (BK / 8); j += 32) {
        const int m = j / (BK / 8), e = j % (BK / 8);
        cp_async16_l2(ring_s + base + slot_fixed + m * X_ROW + 16 * e,
                      x0 + static_cast<size_t>(m) * p.lda + static_cast<size_t>(b) * BK + 8 * e);
      }
    };
    // S groups, some empty: the wait below then counts alike every step. The first S blocks' weights
    // go before the grid dependency wait, into group 0 with block 0's x (so block 0 waits for them all)
    for (int j = 0; j < S && j < nb; j++) issue_weights(j, warp + j * warps);
    grid_dependency_wait();
    if constexpr (FUSE) fusion_loads();
    for (int j = 0; j < S; j++) {
      if (j < nb) issue_x(j, warp + j * warps);
      cp_async_commit();
    }
    const int xrow = min(g, mx - 1) * X_ROW;  // batch rows past M repeat the last
    for (int i = 0, slot = 0; i < nb; i++) {
      cp_async_wait_upto(S - 1);  // block i has landed
      __syncwarp();               // and the x pieces the other lanes copied
      const char* mine = slots + slot * slot_bytes;
      const uint4* w16 = reinterpret_cast<const uint4*>(mine) + lane;
      uint4 cur[SPB][2];
#pragma unroll
      for (int q = 0; q < SPB; q++)
#pragma unroll
        for (int h = 0; h < 2; h++) cur[q][h] = w16[(q * 2 + h) * 32];
      block(cur, warp + i * warps, reinterpret_cast<const uint32_t*>(mine + SPB * 2 * 32 * 16) + lane,
            mine + slot_fixed + xrow);
      __syncwarp();  // every lane is done with the slot
      if (i + S < nb) issue_weights(slot, warp + (i + S) * warps), issue_x(slot, warp + (i + S) * warps);
      cp_async_commit();
      slot = slot + 1 == S ? 0 : slot + 1;
    }
  } else {
    uint4 buf[2][SPB][2];
    int b = warp;
    if (b < nblocks) load(buf[0], b);  // before the wait: the weights do not depend on it
    grid_dependency_wait();
    if constexpr (FUSE) {
      fusion_loads();
      cp_async_commit();
    }
    for (; b < nblocks; b += 2 * warps) {
      if (b + warps < nblocks) load(buf[1], b + warps);  // in flight while this block is decoded
      block(buf[0], b, nullptr, nullptr);
      if (b + warps >= nblocks) break;
      if (b + 2 * warps < nblocks) load(buf[0], b + 2 * warps);
      block(buf[1], b + warps, nullptr, nullptr);
    }
  }
  launch_dependents();  // the weight stream is done: the next kernel may take the SM slots that free up

  // fragment (g, t): columns g and g + 8, batch rows 2t and 2t + 1
  red[warp][g][2 * t] = y[0], red[warp][g][2 * t + 1] = y[1];
  red[warp][g + 8][2 * t] = y[2], red[warp][g + 8][2 * t + 1] = y[3];
  if (FUSE && p.n_partials > 0) {
    cp_async_wait<0>();  // this thread's copies of the partials (a ring's last groups are long done)
    __syncthreads();
    norm_rstd();
  }
  __syncthreads();
  if (p.silu_half) {  // y [M, N / 2]: silu(gate) * up, rounded where kernels/fused.silu_mul rounds
    for (int e = threadIdx.x; e < 8 * 8; e += blockDim.x) {
      const int c = e / 8, m = e % 8;
      if (m >= p.M) continue;
      float vg = 0.f, vu = 0.f;
      for (int w = 0; w < warps; w++) vg += red[w][c][m], vu += red[w][c + 8][m];  // a fixed order
      if (FUSE && p.n_partials > 0) vg *= rstd[m], vu *= rstd[m];
      const float a = __half2float(__float2half_rn(vg)), u = __half2float(__float2half_rn(vu));
      const float silu = __half2float(__float2half_rn(a / (1.f + __expf(-a))));
      static_cast<half*>(p.y)[static_cast<size_t>(m) * p.ldy + n0 + c] = __float2half_rn(silu * u);
    }
    return;
  }
  if constexpr (!FUSE) {
    for (int e = threadIdx.x; e < MMA_COLS * 8; e += blockDim.x) {
      const int c = e / 8, m = e % 8;
      if (m >= p.M) continue;
      float v = 0.f;
      for (int w = 0; w < warps; w++) v += red[w][c][m];  // a fixed order: deterministic
      if (p.bias != nullptr) v += __half2float(static_cast<const half*>(p.bias)[n0 + c]);
      static_cast<half*>(p.y)[static_cast<size_t>(m) * p.ldy + n0 + c] = __float2half_rn(v);
    }
    return;
  }
  __shared__ float sq[MMA_COLS][8];  // the producer's r^2
#pragma unroll
  for (int i = 0; i < EPI; i++) {
    const int e = threadIdx.x + i * blockDim.x, c = e / 8, m = e % 8;
    if (e >= MMA_COLS * 8) break;
    if (m >= p.M) continue;
    float v = 0.f;
    for (int w = 0; w < warps; w++) v += red[w][c][m];  // a fixed order: deterministic
    if (p.n_partials > 0) v *= rstd[m];
    if (p.bias != nullptr) v += __half2float(static_cast<const half*>(p.bias)[n0 + c]);
    const size_t at = static_cast<size_t>(m) * p.ldy + n0 + c;
    if (p.resid != nullptr) {  // r = resid + the product, each rounded as torch rounds them
      const half o = __float2half_rn(v);
      const half r = __float2half_rn(__half2float(rv[i]) + __half2float(o));
      const float rf = __half2float(r);
      static_cast<half*>(p.y)[at] = r;
      static_cast<half*>(p.y_gamma)[at] = __float2half_rn(rf * __half2float(gv[i]));
      sq[c][m] = rf * rf;
    } else {
      static_cast<half*>(p.y)[at] = __float2half_rn(v);
    }
  }
  if (p.resid != nullptr) {
    __syncthreads();
    if (threadIdx.x < p.M) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < MMA_COLS; c++) s += sq[c][threadIdx.x];
      p.partials[static_cast<size_t>(threadIdx.x) * gridDim.x + blockIdx.x] = s;
    }
  }
}

}  // namespace flotilla::gemv
