// C++ unit tests of the index arithmetic in csrc/pack_index.h (run by ctest, no torch).
// Each closed form is checked against a brute-force construction of HF's own procedure
// (nested loops of the reshape/permute, the padded window tiling), over awkward sizes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "pack_index.h"

static int failures = 0;
#define EXPECT(cond, ...)                                                  \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++failures;                                                          \
      std::fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                   \
      std::fprintf(stderr, "\n");                                          \
    }                                                                      \
  } while (0)

using namespace paravt;

// HF patchify order: view (t, bh, m, bw, m) -> permute (t, bh, bw, mh, mw): enumerate it.
static void test_patch_position() {
  const int64_t ms[] = {1, 2, 3};
  for (int64_t m : ms)
    for (int64_t bh = 1; bh <= 5; ++bh)
      for (int64_t bw = 1; bw <= 7; bw += 3) {
        const int64_t h = bh * m, w = bw * m, t = 3;
        int64_t j = 0;
        for (int64_t ti = 0; ti < t; ++ti)
          for (int64_t r = 0; r < bh; ++r)
            for (int64_t c = 0; c < bw; ++c)
              for (int64_t ir = 0; ir < m; ++ir)
                for (int64_t ic = 0; ic < m; ++ic, ++j) {
                  const PatchPos p = patch_position(j, h, w, m);
                  EXPECT(p.ti == ti && p.row == r * m + ir && p.col == c * m + ic,
                         "j=%lld h=%lld w=%lld m=%lld", (long long)j, (long long)h,
                         (long long)w, (long long)m);
                }
      }
}

static void test_patch_element() {
  const int64_t tp = 2, p = 14;
  int64_t e = 0;
  for (int64_t c = 0; c < 3; ++c)
    for (int64_t t = 0; t < tp; ++t)
      for (int64_t y = 0; y < p; ++y)
        for (int64_t x = 0; x < p; ++x, ++e) {
          const PatchElem el = patch_element(e, tp, p);
          EXPECT(el.c == c && el.tpi == t && el.py == y && el.px == x, "e=%lld", (long long)e);
        }
}

static void test_source_frame() {
  // T = 5, tp = 2: slots 0..5 read frames 0,1,2,3,4,4 (the processor repeats the last).
  const int64_t want[] = {0, 1, 2, 3, 4, 4};
  for (int64_t s = 0; s < 6; ++s)
    EXPECT(source_frame(s / 2, s % 2, 2, 5) == want[s], "slot %lld", (long long)s);
  EXPECT(source_frame(0, 1, 2, 1) == 0, "single frame pads with itself");
}

static void test_axis_taps() {
  const int64_t sides[] = {2, 7, 48};
  const int64_t sizes[] = {1, 2, 3, 28, 59, 111};
  for (int64_t side : sides)
    for (int64_t size : sizes)
      for (int64_t i = 0; i < size; ++i) {
        const AxisTaps a = axis_taps(i, size, side);
        const double src = size > 1 ? double(i) * (side - 1) / double(size - 1) : 0.0;
        const double fl = std::floor(src);
        EXPECT(a.tap0 == std::min<int64_t>((int64_t)fl, side - 1), "tap0 i=%lld", (long long)i);
        EXPECT(a.tap1 == std::min<int64_t>((int64_t)fl + 1, side - 1), "tap1 i=%lld",
               (long long)i);
        EXPECT(std::fabs(a.w0 - (1.0 - (src - fl))) < 1e-5, "w0 i=%lld size=%lld side=%lld",
               (long long)i, (long long)size, (long long)side);
        EXPECT(std::fabs(a.w0 + a.w1 - 1.0f) < 1e-6, "weights sum to 1");
      }
  // align_corners: the last patch samples the last table row exactly.
  const AxisTaps last = axis_taps(27, 28, 48);
  EXPECT(last.tap0 == 47 && last.w0 == 1.0f && last.w1 == 0.0f, "last row");
  int64_t idx[4];
  float wt[4];
  interp_taps(0, 0, 4, 6, 48, idx, wt);
  EXPECT(idx[0] == 0 && idx[1] == 1 && idx[2] == 48 && idx[3] == 49, "corner taps");
  EXPECT(wt[0] == 1.0f && wt[1] == 0.0f && wt[2] == 0.0f && wt[3] == 0.0f, "corner weights");
}

// HF get_vision_window_index for one crop: pad by vw - l % vw with -100, tile, drop pads.
static void hf_window(int64_t t, int64_t lh, int64_t lw, int64_t vw, std::vector<int64_t>& idx,
                      std::vector<int64_t>& lens) {
  const int64_t ph = lh + (vw - lh % vw), pw = lw + (vw - lw % vw);
  for (int64_t ti = 0; ti < t; ++ti)
    for (int64_t wy = 0; wy < ph / vw; ++wy)
      for (int64_t wx = 0; wx < pw / vw; ++wx) {
        int64_t count = 0;
        for (int64_t y = wy * vw; y < (wy + 1) * vw; ++y)
          for (int64_t x = wx * vw; x < (wx + 1) * vw; ++x)
            if (y < lh && x < lw) {
              idx.push_back((ti * lh + y) * lw + x);
              ++count;
            }
        if (count) lens.push_back(count);  // unique_consecutive drops empty windows
      }
}

static void test_window_index() {
  const int64_t vw = 4;
  for (int64_t t = 1; t <= 3; ++t)
    for (int64_t lh = 1; lh <= 13; lh += 3)
      for (int64_t lw = 1; lw <= 9; ++lw) {
        std::vector<int64_t> want_idx, want_len;
        hf_window(t, lh, lw, vw, want_idx, want_len);
        const int64_t nw = num_windows(t, lh, lw, vw);
        EXPECT((int64_t)want_len.size() == nw, "window count t=%lld lh=%lld lw=%lld",
               (long long)t, (long long)lh, (long long)lw);
        std::vector<int64_t> idx(t * lh * lw), len(nw);
        window_index_crop(t, lh, lw, vw, 10, idx.data(), len.data());
        for (size_t k = 0; k < idx.size(); ++k)
          EXPECT(idx[k] == want_idx[k] + 10, "index %zu (t=%lld lh=%lld lw=%lld)", k,
                 (long long)t, (long long)lh, (long long)lw);
        for (size_t k = 0; k < len.size() && k < want_len.size(); ++k)
          EXPECT(len[k] == want_len[k], "window %zu length", k);
      }
}

int main() {
  test_patch_position();
  test_patch_element();
  test_source_frame();
  test_axis_taps();
  test_window_index();
  if (failures) {
    std::fprintf(stderr, "test_pack_index: %d failure(s)\n", failures);
    return 1;
  }
  std::printf("test_pack_index: all checks passed\n");
  return 0;
}
