// The GEMV's wide tensor-core plan for 9..16 batch rows (fp16 activations, GPTQ layouts: zeros
// constant or uint8; R = 16 or 32 words a block; N a multiple of C = 8 NC): x is the MMA's A operand
// (its 16 rows are the 16 batch rows), the decoded weights its B operand (8 output columns an MMA),
// and one warp computes NC such column octets, C = 8 NC output columns, so that each x fragment a lane
// loads feeds NC MMAs. Instantiated at NC = 2 (16 columns): the only width the registry picks.
//
// Why (bench/NOTES-kernels.md, round 13): the M <= 8 plan (gemv_mma.cuh) puts 16 columns on the MMA's
// rows and the batch rows on its 8 columns; a second tile of 8 batch rows there (round 12's branch
// gemv16) doubles the x a lane loads per weight byte, 4 bytes of x per byte of weights through L1 at 16
// rows, and lost to the Triton tiles. Here x per weight byte is 4 M / C: 1 at C = 64. Measured (H100):
// ahead of the Triton tiles at 9-16 rows on 4096x4096 only (8.3 against 9.3 µs back to back at 16 rows),
// behind on the larger llama-3-8b shapes at any width: 16, 32 and 64 columns a warp, and the weights one
// or two strips ahead, all within ~10% (x's delivery is not the limit; branch wide-deep keeps the widths
// and the deeper buffer).
//
// Fragments (mma.m16n8k16, row.col): lane (g, t) = (lane / 4, lane % 4) holds A rows g and g + 8 at k
// slots (2t, 2t+1) and (2t+8, 2t+9), B column g at the same slots, C rows g, g + 8 at columns 2t, 2t+1.
// Per strip of 16 words of each column the lane loads words 4t..4t+3 of its column of every octet (16
// bytes each): word i holds the row pair 2i, 2i+1 of the lane's 8 consecutive rows of each run s (the
// layout: gemv.cuh), and x of batch rows g and g + 8 at those 8 rows (one 16-byte load a batch row and
// run). The k order: for MMA h of run s, slots (2t, 2t+1) are word 2h's pair, (2t+8, 2t+9) word 2h+1's,
// for x and for the weights alike. B is q - z, exact in fp16 (gemv.cuh PairF16); each group's products
// go into their own accumulators, times the group's scales (columns 2t, 2t+1 of the octet: one 32-bit
// load) into the output fragment at the end of the strip.
//
// Work split: a CTA computes C columns (under silu_half: C / 2 of gate and the same C / 2 of up), its
// warps taking whole blocks of the input axis (blocks warp, warp + warps, ...), the next strip's
// weights (and, at a block's first strip, its scales and zeros) loaded before the current one is
// decoded (a register double buffer); the warps' sums meet in shared memory in a fixed order
// (deterministic, no workspace). Not here: the ring, PDL and the residual and norm fusion.
#pragma once
#include "gemv.cuh"
#include "gemv_mma.cuh"

namespace flotilla::gemv {

constexpr int WIDE_ROWS = 16;

// grid: N / (8 NC) blocks (silu_half: (N / 2) / (4 NC)) of 32 * warps threads
template <int BITS, int MODE, int TPG, int LOG2R, int NC>
__global__ void __launch_bounds__(32 * MAX_WARPS) gemv_wide_kernel(const GemvParams p) {
  constexpr int P = 16 / BITS, NG = P / TPG, R = 1 << LOG2R, SPB = R / 16;
  constexpr int BK = 2 * R * P;  // input rows a block
  constexpr int C = 8 * NC;      // output columns a CTA
  static_assert(SPB >= 1 && NG >= 1 && (NC == 2 || NC == 4 || NC == 8), "whole strips and groups; 2, 4 or 8 octets");
  __shared__ float red[MAX_WARPS][WIDE_ROWS][C + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // octet c's first column: C consecutive columns, or under silu_half C / 2 of gate (octets < NC / 2)
  // and the same C / 2 of up
  const int half_n = p.silu_half;
  const int n0 = blockIdx.x * (half_n ? C / 2 : C);
  auto col_of = [&](int c) { return half_n ? (c < NC / 2 ? n0 + 8 * c : half_n + n0 + 8 * (c - NC / 2)) : n0 + 8 * c; };
  // lane (g, t): 16 bytes of strip q of block b of octet c at wc + col_of(c) * KW / 4 + b * R / 4 + 4q (uint4 units)
  const uint4* wc = pinned(reinterpret_cast<const uint4*>(p.words + static_cast<size_t>(g) * p.KW) + t);
  const size_t col_words4 = static_cast<size_t>(p.KW) / 4;  // uint4 a column
  // batch rows g and g + 8 (rows past M repeat the last: their outputs are never stored)
  const half* x0 = pinned(static_cast<const half*>(p.x) + static_cast<size_t>(min(g, p.M - 1)) * p.lda + 8 * t);
  const half* x1 = pinned(static_cast<const half*>(p.x) + static_cast<size_t>(min(g + 8, p.M - 1)) * p.lda + 8 * t);
  const uint64_t policy = evict_first_policy();
  const int nblocks = p.KW >> LOG2R;

  float y[NC][4];
#pragma unroll
  for (int c = 0; c < NC; c++) y[c][0] = y[c][1] = y[c][2] = y[c][3] = 0.f;

  // A block's table (its scales and zeros at the CTA's columns, each group's row of C scales then
  // C zero bytes) rides through a 2-slot ring of the warp in shared memory, copied by the warp's lanes
  // together (4-byte cp.async) with the block's first strip; the weights stream into registers.
  constexpr int TAB = NG * C * (MODE == ZP ? 3 : 2);  // bytes a slot
  __shared__ __align__(16) char tab_smem[MAX_WARPS][2][TAB];
  const unsigned tab_s = static_cast<unsigned>(__cvta_generic_to_shared(&tab_smem[warp][0][0]));
  auto load = [&](uint4 (&w)[NC], int slot, int b, int sq) {
#pragma unroll
    for (int c = 0; c < NC; c++)
      w[c] = load_stream(wc + static_cast<size_t>(col_of(c)) * col_words4 + b * (R / 4) + 4 * sq, policy);
    if (sq == 0) {
      // word j of the slot: group j / (TAB / 4 / NG); within it scales' words (C / 2) then zeros' (C / 4),
      // each half of the columns (C / 2 of them) from col_of(0) and col_of(NC / 2)
      for (int j = lane; j < TAB / 4; j += 32) {
        const int q = j / (TAB / 4 / NG), e = j % (TAB / 4 / NG);
        const size_t row = static_cast<size_t>(group_of(b * P + q * TPG, p.group_magic)) * p.N;
        const char* src;
        if (e < C / 2) {  // scale words: 2 columns each
          const int col = e < C / 4 ? col_of(0) + 2 * e : col_of(NC / 2) + 2 * (e - C / 4);
          src = reinterpret_cast<const char*>(p.scales + row + col);
        } else {  // zero words: 4 columns each
          const int z = e - C / 2;
          const int col = z < C / 8 ? col_of(0) + 4 * z : col_of(NC / 2) + 4 * (z - C / 8);
          src = reinterpret_cast<const char*>(p.zeros + row + col);
        }
        cp_async4(tab_s + slot * TAB + 4 * j, src);
      }
    }
    cp_async_commit();
  };
  // decode and multiply strip sq of block b
  auto strip = [&](const uint4 (&cur)[NC], int slot, int b, int sq) {
    const char* tab = &tab_smem[warp][slot][0];
    uint32_t w8[NC][4];
#pragma unroll
    for (int c = 0; c < NC; c++)
      w8[c][0] = cur[c].x >> 8, w8[c][1] = cur[c].y >> 8, w8[c][2] = cur[c].z >> 8, w8[c][3] = cur[c].w >> 8;
    const size_t xoff = static_cast<size_t>(b) * BK + 32 * sq;
    static_for<NG>([&](auto qc_) {
      constexpr int q = decltype(qc_)::value;
      float acc[NC][4];
#pragma unroll
      for (int c = 0; c < NC; c++) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
      uint32_t ze[NC], zo[NC];
#pragma unroll
      for (int c = 0; c < NC; c++) {
        // zero of column 8c + g: byte 8c + g of the group's zeros (after its C scales)
        const uint32_t z = MODE == ZP ? static_cast<uint32_t>(static_cast<const uint8_t*>(
                                            static_cast<const void*>(tab + q * (TAB / NG) + 2 * C))[8 * c + g])
                                      : static_cast<uint32_t>(p.zero_const);
        ze[c] = zero_const_of<BITS, 0>(z), zo[c] = zero_const_of<BITS, 1>(z);
      }
      static_for<TPG>([&](auto rc_) {
        constexpr int s = q * TPG + decltype(rc_)::value;
        const uint4 a = load_x(x0 + xoff + s * 2 * R), bb = load_x(x1 + xoff + s * 2 * R);
        const uint32_t xa[4] = {a.x, a.y, a.z, a.w}, xb[4] = {bb.x, bb.y, bb.z, bb.w};
#pragma unroll
        for (int c = 0; c < NC; c++) {
          const uint32_t wv[4] = {cur[c].x, cur[c].y, cur[c].z, cur[c].w};
          using D = PairF16<BITS>;
#pragma unroll
          for (int h = 0; h < 2; h++)
            mma_f16(acc[c], xa[2 * h], xb[2 * h], xa[2 * h + 1], xb[2 * h + 1],
                    h2_bits(D::template get<s>(wv[2 * h], w8[c][2 * h], ze[c], zo[c])),
                    h2_bits(D::template get<s>(wv[2 * h + 1], w8[c][2 * h + 1], ze[c], zo[c])));
        }
      });
#pragma unroll
      for (int c = 0; c < NC; c++) {
        const float2 sc = __half22float2(*reinterpret_cast<const half2*>(tab + q * (TAB / NG) + 2 * (8 * c + 2 * t)));
        y[c][0] = fmaf(sc.x, acc[c][0], y[c][0]), y[c][1] = fmaf(sc.y, acc[c][1], y[c][1]);
        y[c][2] = fmaf(sc.x, acc[c][2], y[c][2]), y[c][3] = fmaf(sc.y, acc[c][3], y[c][3]);
      }
    });
  };

  // the warp's strips u = 0, 1, ...: block warp + (u / SPB) * warps, strip u % SPB. Two blocks an
  // iteration, so that every buffer index is a constant: strip k of it in w[k % 2], its block's table
  // in slot k / SPB; strip u + 1's loads go out before strip u is decoded (one cp.async group a strip).
  // (Two strips ahead, three register buffers, measured no faster in round 13: branch wide-deep.)
  const int nb = warp < nblocks ? (nblocks - 1 - warp) / warps + 1 : 0;
  const int units = nb * SPB;
  uint4 w[2][NC];
  if (units > 0) load(w[0], 0, warp, 0);
  for (int u = 0; u < units; u += 2 * SPB) {
    const int b0 = warp + (u / SPB) * warps;
    static_for<2 * SPB>([&](auto k_) {
      constexpr int k = decltype(k_)::value, k1 = (k + 1) % (2 * SPB);
      if (u + k >= units) return;
      if (u + k + 1 < units) load(w[k1 % 2], k1 / SPB, b0 + ((k + 1) / SPB) * warps, k1 % SPB);
      else cp_async_commit();  // an empty group: the wait below counts alike every strip
      cp_async_wait<1>();      // strip u + k's table has landed
      __syncwarp();            // with the other lanes' pieces
      strip(w[k % 2], k / SPB, b0 + (k / SPB) * warps, k % SPB);
      __syncwarp();  // every lane is done with the table slot before the next strip's load may refill it
    });
  }

  // fragment of octet c: batch rows g, g + 8, columns 8c + 2t, 8c + 2t + 1
#pragma unroll
  for (int c = 0; c < NC; c++) {
    red[warp][g][8 * c + 2 * t] = y[c][0], red[warp][g][8 * c + 2 * t + 1] = y[c][1];
    red[warp][g + 8][8 * c + 2 * t] = y[c][2], red[warp][g + 8][8 * c + 2 * t + 1] = y[c][3];
  }
  __syncthreads();
  if (half_n) {  // y [M, N / 2]: silu(gate) * up, rounded where kernels/fused.silu_mul rounds
    for (int e = threadIdx.x; e < WIDE_ROWS * (C / 2); e += blockDim.x) {
      const int m = e / (C / 2), c = e % (C / 2);
      if (m >= p.M) continue;
      float vg = 0.f, vu = 0.f;
      for (int v = 0; v < warps; v++) vg += red[v][m][c], vu += red[v][m][c + C / 2];  // a fixed order
      const float a = __half2float(__float2half_rn(vg)), u = __half2float(__float2half_rn(vu));
      const float silu = __half2float(__float2half_rn(a / (1.f + __expf(-a))));
      static_cast<half*>(p.y)[static_cast<size_t>(m) * p.ldy + n0 + c] = __float2half_rn(silu * u);
    }
    return;
  }
  for (int e = threadIdx.x; e < WIDE_ROWS * C; e += blockDim.x) {
    const int m = e / C, c = e % C;
    if (m >= p.M) continue;
    float v = 0.f;
    for (int k = 0; k < warps; k++) v += red[k][m][c];  // a fixed order: deterministic
    if (p.bias != nullptr) v += __half2float(static_cast<const half*>(p.bias)[n0 + c]);
    static_cast<half*>(p.y)[static_cast<size_t>(m) * p.ldy + n0 + c] = __float2half_rn(v);
  }
}

}  // namespace flotilla::gemv
