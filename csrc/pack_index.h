// Index arithmetic of paravt's pack_vision, shared by the CPU op, the CUDA kernels and the
// C++ unit tests. Plain C++ (no torch headers, no CUDA headers): every function is
// PARAVT_HD so nvcc compiles it for the device and a host compiler for the CPU.
//
// Conventions (they are HF Qwen-VL's; the tests compare against HF's own code):
//   * A crop has grid (t, h, w): t temporal patches, h x w spatial patches per frame.
//   * Packed patches of one crop are ordered (ti, block_row, block_col, in_row, in_col) with
//     m x m merge blocks, i.e. patch j of a crop sits at spatial (row, col) =
//     (block_row * m + in_row, block_col * m + in_col) of temporal patch ti.
//   * One patch row of pixel_values has C * tp * p * p floats ordered (c, tpi, py, px).
//   * Floating point in the position-embedding interpolation mirrors HF's op order exactly
//     (one rounding per op, no FMA contraction): the host build uses -ffp-contract=off and the
//     device path uses the _rn intrinsics.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define PARAVT_HD __host__ __device__ __forceinline__
#else
#define PARAVT_HD inline
#endif

namespace paravt {

// Spatial position of the j-th patch of one crop (j counts over all its t * h * w patches).
struct PatchPos {
  int64_t ti;   // temporal patch index
  int64_t row;  // patch row in the frame, 0 .. h-1
  int64_t col;  // patch column in the frame, 0 .. w-1
};

PARAVT_HD PatchPos patch_position(int64_t j, int64_t h, int64_t w, int64_t m) {
  const int64_t hw = h * w;
  const int64_t f = j % hw;  // index within one temporal patch
  const int64_t mm = m * m;
  const int64_t blocks_w = w / m;
  const int64_t in_col = f % m;
  const int64_t in_row = (f / m) % m;
  const int64_t block_col = (f / mm) % blocks_w;
  const int64_t block_row = f / (mm * blocks_w);
  PatchPos pos;
  pos.ti = j / hw;
  pos.row = block_row * m + in_row;
  pos.col = block_col * m + in_col;
  return pos;
}

// Element e (0 .. C*tp*p*p-1) of one patch row: channel, temporal offset and pixel offset.
struct PatchElem {
  int64_t c;
  int64_t tpi;
  int64_t py;
  int64_t px;
};

PARAVT_HD PatchElem patch_element(int64_t e, int64_t tp, int64_t p) {
  const int64_t pp = p * p;
  PatchElem el;
  el.c = e / (tp * pp);
  el.tpi = (e / pp) % tp;
  el.py = (e / p) % p;
  el.px = e % p;
  return el;
}

// Source frame of temporal slot (ti, tpi) in a clip of T frames: frames past the end repeat the
// last one (the processor pads an odd T that way).
PARAVT_HD int64_t source_frame(int64_t ti, int64_t tpi, int64_t tp, int64_t T) {
  const int64_t f = ti * tp + tpi;
  return f < T ? f : T - 1;
}

// Bilinear, align_corners=True taps of one axis: target index `idx` on an axis of `size`
// patches resampled from a `side`-long learned table. Mirrors transformers'
// _interpolation_axis_taps_weights(mode="bilinear", align_corners=True, padding="border"):
//   src = float(idx) * (side - 1) / max(size - 1, 1);  fl = floor(src)
//   tap_k = clamp(fl + k, 0, side - 1);  weight_k = max(1 - |(src - fl) - k|, 0),  k in {0, 1}.
struct AxisTaps {
  int64_t tap0, tap1;
  float w0, w1;
};

PARAVT_HD float fmul_exact(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PARAVT_HD float fdiv_exact(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PARAVT_HD float fsub_exact(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
PARAVT_HD float fabs_(float a) { return a < 0.0f ? -a : a; }
PARAVT_HD float ffloor_(float a) {
  // floor for |a| < 2^23 (positions are small); avoids <cmath> in device/host-shared code.
  float t = (float)(int64_t)a;
  return t > a ? t - 1.0f : t;
}

PARAVT_HD AxisTaps axis_taps(int64_t idx, int64_t size, int64_t side) {
  const int64_t denom = size - 1 > 1 ? size - 1 : 1;
  const float src = fdiv_exact(fmul_exact((float)idx, (float)(side - 1)), (float)denom);
  const float fl = ffloor_(src);
  const float frac = fsub_exact(src, fl);
  int64_t t0 = (int64_t)fl;
  int64_t t1 = t0 + 1;
  t0 = t0 < 0 ? 0 : (t0 > side - 1 ? side - 1 : t0);
  t1 = t1 < 0 ? 0 : (t1 > side - 1 ? side - 1 : t1);
  float w0 = fsub_exact(1.0f, fabs_(fsub_exact(frac, 0.0f)));
  float w1 = fsub_exact(1.0f, fabs_(fsub_exact(frac, 1.0f)));
  AxisTaps a;
  a.tap0 = t0;
  a.tap1 = t1;
  a.w0 = w0 > 0.0f ? w0 : 0.0f;
  a.w1 = w1 > 0.0f ? w1 : 0.0f;
  return a;
}

// The 4 bilinear taps of patch (row, col) of an h x w grid into the flattened side x side
// table, in HF's order (h0w0, h0w1, h1w0, h1w1); weight = w_h * w_w.
PARAVT_HD void interp_taps(int64_t row, int64_t col, int64_t h, int64_t w, int64_t side,
                           int64_t idx[4], float wt[4]) {
  const AxisTaps ah = axis_taps(row, h, side);
  const AxisTaps aw = axis_taps(col, w, side);
  idx[0] = ah.tap0 * side + aw.tap0;
  idx[1] = ah.tap0 * side + aw.tap1;
  idx[2] = ah.tap1 * side + aw.tap0;
  idx[3] = ah.tap1 * side + aw.tap1;
  wt[0] = fmul_exact(ah.w0, aw.w0);
  wt[1] = fmul_exact(ah.w0, aw.w1);
  wt[2] = fmul_exact(ah.w1, aw.w0);
  wt[3] = fmul_exact(ah.w1, aw.w1);
}

// Qwen2.5-VL window attention: number of non-empty windows of one crop and their layout.
// The merged grid (lh, lw) = (h/m, w/m) is tiled by vw x vw windows, vw = window_size/m/patch;
// HF pads every axis by vw - l % vw (a whole empty window when l % vw == 0) and drops the
// empty windows again with unique_consecutive, so only ceil(l / vw) windows per axis remain.
PARAVT_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

PARAVT_HD int64_t num_windows(int64_t t, int64_t lh, int64_t lw, int64_t vw) {
  return t * ceil_div(lh, vw) * ceil_div(lw, vw);
}

// Writes the window-ordered merged-token ids of one crop (offset by `token_offset`, the number
// of merged tokens of earlier crops) into `index_out` (t*lh*lw entries) and the token count of
// each non-empty window into `window_len_out` (num_windows entries). Windows are visited
// (ti, window_row, window_col); tokens inside a window row-major.
inline void window_index_crop(int64_t t, int64_t lh, int64_t lw, int64_t vw, int64_t token_offset,
                              int64_t* index_out, int64_t* window_len_out) {
  const int64_t nwh = ceil_div(lh, vw), nww = ceil_div(lw, vw);
  int64_t k = 0, win = 0;
  for (int64_t ti = 0; ti < t; ++ti) {
    for (int64_t wy = 0; wy < nwh; ++wy) {
      const int64_t y1 = (wy + 1) * vw < lh ? (wy + 1) * vw : lh;
      for (int64_t wx = 0; wx < nww; ++wx) {
        const int64_t x1 = (wx + 1) * vw < lw ? (wx + 1) * vw : lw;
        const int64_t start = k;
        for (int64_t y = wy * vw; y < y1; ++y)
          for (int64_t x = wx * vw; x < x1; ++x)
            index_out[k++] = token_offset + (ti * lh + y) * lw + x;
        window_len_out[win++] = k - start;
      }
    }
  }
}

}  // namespace paravt
