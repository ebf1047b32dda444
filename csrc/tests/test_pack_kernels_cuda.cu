// GPU test of csrc/cuda/pack_kernels.cu through its C API: kernel output vs a host loop over
// the same definition (pixel_values[g, (c, tpi, py, px)] = lut[c, frame pixel]). Exits 77
// (ctest: skipped) when no GPU is present, so it is compile-checked everywhere and run where
// a GPU exists.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/pack_kernels.h"
#include "pack_index.h"

#define CHECK_CUDA(x)                                                        \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));   \
      return 1;                                                              \
    }                                                                        \
  } while (0)

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("test_pack_kernels_cuda: no CUDA device, skipped\n");
    return 77;
  }
  const int64_t p = 16, tp = 2, m = 2, side = 48, D = 3 * tp * p * p;
  const int64_t shapes[][3] = {{3, 64, 96}, {2, 32, 32}, {5, 96, 64}};  // T, H, W
  const int64_t n = 3;
  std::vector<paravt_crop_desc> desc(n);
  std::vector<std::vector<uint8_t>> host(n);
  std::vector<uint8_t*> dev(n);
  int64_t off = 0;
  srand(1234);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = shapes[i][0], H = shapes[i][1], W = shapes[i][2];
    host[i].resize(T * H * W * 3);
    for (auto& v : host[i]) v = static_cast<uint8_t>(rand() & 255);
    CHECK_CUDA(cudaMalloc(&dev[i], host[i].size()));
    CHECK_CUDA(cudaMemcpy(dev[i], host[i].data(), host[i].size(), cudaMemcpyHostToDevice));
    desc[i] = {dev[i], T, H, W, H / p, W / p, off};
    off += ((T + tp - 1) / tp) * (H / p) * (W / p);
  }
  const int64_t N = off;
  std::vector<float> lut(3 * 256);
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v) lut[c * 256 + v] = (float(v) - 127.5f - c) / 127.5f;

  paravt_crop_desc* d_desc;
  float *d_lut, *d_out, *d_wt;
  int64_t *d_pos, *d_idx;
  CHECK_CUDA(cudaMalloc(&d_desc, n * sizeof(paravt_crop_desc)));
  CHECK_CUDA(cudaMemcpy(d_desc, desc.data(), n * sizeof(paravt_crop_desc), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_lut, lut.size() * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(d_lut, lut.data(), lut.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_out, N * D * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_pos, N * 2 * sizeof(int64_t)));
  CHECK_CUDA(cudaMalloc(&d_idx, N * 4 * sizeof(int64_t)));
  CHECK_CUDA(cudaMalloc(&d_wt, N * 4 * sizeof(float)));
  CHECK_CUDA(static_cast<cudaError_t>(
      paravt_pack_pixels_cuda(d_desc, n, d_lut, d_out, 4, N, p, tp, m, nullptr)));
  CHECK_CUDA(static_cast<cudaError_t>(
      paravt_vision_meta_cuda(d_desc, n, N, m, side, d_pos, d_idx, d_wt, nullptr)));
  std::vector<float> out(N * D), wt(N * 4);
  std::vector<int64_t> pos(N * 2), idx(N * 4);
  CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(pos.data(), d_pos, pos.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(idx.data(), d_idx, idx.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(wt.data(), d_wt, wt.size() * sizeof(float), cudaMemcpyDeviceToHost));

  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const paravt_crop_desc& c = desc[i];
    const int64_t np = ((c.T + tp - 1) / tp) * c.gh * c.gw;
    for (int64_t j = 0; j < np; ++j) {
      const int64_t g = c.patch_offset + j;
      const paravt::PatchPos ps = paravt::patch_position(j, c.gh, c.gw, m);
      bad += pos[2 * g] != ps.row || pos[2 * g + 1] != ps.col;
      int64_t ri[4];
      float rw[4];
      paravt::interp_taps(ps.row, ps.col, c.gh, c.gw, side, ri, rw);
      for (int k = 0; k < 4; ++k) bad += idx[4 * g + k] != ri[k] || wt[4 * g + k] != rw[k];
      for (int64_t e = 0; e < D; ++e) {
        const paravt::PatchElem el = paravt::patch_element(e, tp, p);
        const int64_t f = paravt::source_frame(ps.ti, el.tpi, tp, c.T);
        const uint8_t v =
            host[i][((f * c.H + ps.row * p + el.py) * c.W + ps.col * p + el.px) * 3 + el.c];
        bad += out[g * D + e] != lut[el.c * 256 + v];
      }
    }
  }
  if (bad) {
    std::fprintf(stderr, "test_pack_kernels_cuda: %lld mismatches\n", (long long)bad);
    return 1;
  }
  std::printf("test_pack_kernels_cuda: %lld patches match\n", (long long)N);
  return 0;
}
