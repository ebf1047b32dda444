// CPU implementation of paravt::pack_vision and paravt::vision_metadata.
//
// Pixels: one pass over the output, parallel over patches (at::parallel_for, OpenMP in torch's
// CPU build). uint8 -> float goes through a (3, 256) lookup table built by the Python wrapper
// with HF's exact arithmetic, so normalisation is a gather and bit-identical to the processor.
// Metadata: closed-form per-patch index arithmetic from pack_index.h, also parallel.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>

#include "pack_index.h"
#include "pack_vision.h"

namespace paravt {

CropLayout crop_layout(const std::vector<at::Tensor>& crops, int64_t patch_size,
                       int64_t temporal_patch_size, int64_t merge_size) {
  TORCH_CHECK(!crops.empty(), "pack_vision: got an empty list of crops; pass at least one crop.");
  TORCH_CHECK(patch_size > 0 && temporal_patch_size > 0 && merge_size > 0,
              "pack_vision: patch_size (", patch_size, "), temporal_patch_size (",
              temporal_patch_size, ") and merge_size (", merge_size, ") must all be positive.");
  const int64_t factor = patch_size * merge_size;
  const auto device = crops[0].device();
  CropLayout L;
  const size_t n = crops.size();
  L.T.resize(n);
  L.H.resize(n);
  L.W.resize(n);
  L.grid.resize(3 * n);
  L.patch_offset.assign(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const auto& c = crops[i];
    TORCH_CHECK(c.scalar_type() == at::kByte, "pack_vision: crop ", i,
                " has dtype ", c.scalar_type(),
                "; expected uint8 RGB frames (decode to uint8 and do not normalise first).");
    TORCH_CHECK(c.dim() == 4 && c.size(3) == 3, "pack_vision: crop ", i, " has shape ",
                c.sizes(), "; expected (T, H, W, 3) channels-last RGB frames.");
    TORCH_CHECK(c.device() == device, "pack_vision: crop ", i, " is on ", c.device(),
                " but crop 0 is on ", device, "; move all crops to one device.");
    const int64_t T = c.size(0), H = c.size(1), W = c.size(2);
    TORCH_CHECK(T > 0, "pack_vision: crop ", i, " has no frames; drop it or decode at least one.");
    TORCH_CHECK(H > 0 && W > 0 && H % factor == 0 && W % factor == 0, "pack_vision: crop ", i,
                " has frame size ", H, "x", W, ", not a positive multiple of patch*merge = ",
                factor, "; resize it with paravt.vision.resize.smart_resize first.");
    L.T[i] = T;
    L.H[i] = H;
    L.W[i] = W;
    const int64_t t = (T + temporal_patch_size - 1) / temporal_patch_size;
    L.grid[3 * i] = t;
    L.grid[3 * i + 1] = H / patch_size;
    L.grid[3 * i + 2] = W / patch_size;
    L.patch_offset[i + 1] = L.patch_offset[i] + t * (H / patch_size) * (W / patch_size);
  }
  return L;
}

void check_lut(const at::Tensor& lut, const at::Device& device) {
  const auto dt = lut.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && lut.dim() == 2 &&
                  lut.size(0) == 3 && lut.size(1) == 256,
              "pack_vision: lut must be a float32, bfloat16 or float16 (3, 256) table of "
              "normalised values per channel and uint8 level, got ",
              dt, " ", lut.sizes(),
              "; build it with paravt.vision.pack.normalization_lut(mean, std).");
  TORCH_CHECK(lut.device() == device, "pack_vision: lut is on ", lut.device(),
              " but the crops are on ", device, "; move the lut to the crops' device.");
}

// The (N, D) output is large and written once; its first-touch page faults cost about as much
// as the packing itself (measured on the 2-core build box: allocating and filling 100 MB fresh
// takes 29 ms, filling it again 4 ms). So outputs come from a small pool: when the last tensor
// using a buffer is freed, the buffer (its pages already faulted in) is kept for the next pack
// of a similar size instead of going back to the OS. Bounded by PARAVT_PACK_POOL_MB (default
// 1/16 of RAM, at most 4096; 0 disables), best fit within 2x of the request; a buffer is
// handed out again only after its deleter ran, i.e. when no tensor references it any more. Transparent huge pages
// (PARAVT_PACK_THP=1: 2 MiB aligned + MADV_HUGEPAGE) stay opt-in: they halved the fault cost
// of 80 MB packs but made 300 MB packs swing between 190 ms and 3 s (direct compaction).
namespace {

class BufferPool {
 public:
  BufferPool() {
    // fork() while another thread holds mu_ (a deleter returning a buffer) would leave the
    // child's mutex locked forever: hold it across the fork, release it on both sides.
    pthread_atfork([] { pool_mutex().lock(); }, [] { pool_mutex().unlock(); },
                   [] { pool_mutex().unlock(); });
  }

  void* take(size_t bytes, size_t* got) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes) {
        void* ptr = it->second;
        *got = it->first;
        cached_ -= it->first;
        free_.erase(it);
        return ptr;
      }
    }
    *got = bytes;
    return allocate(bytes);
  }

  void give(void* ptr, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + bytes <= cap_) {
        free_.emplace(bytes, ptr);
        cached_ += bytes;
        return;
      }
    }
    std::free(ptr);
  }

 private:
  static void* allocate(size_t bytes) {
    constexpr size_t kHuge = size_t(1) << 21;
    static const bool use_thp = [] {
      const char* v = std::getenv("PARAVT_PACK_THP");
      return v != nullptr && v[0] == '1';
    }();
    void* ptr = nullptr;
    const size_t align = use_thp && bytes >= 2 * kHuge ? kHuge : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    TORCH_CHECK(posix_memalign(&ptr, align, rounded) == 0 && ptr != nullptr,
                "pack_vision: could not allocate ", bytes, " bytes for pixel_values; pack fewer "
                "crops per call or pass a preallocated buffer (out=).");
#ifdef MADV_HUGEPAGE
    if (align == kHuge) madvise(ptr, rounded, MADV_HUGEPAGE);  // advisory
#endif
    return ptr;
  }

  static std::mutex& pool_mutex();

  std::mutex& mu_ = pool_mutex();
  std::multimap<size_t, void*> free_;
  size_t cached_ = 0;
  const size_t cap_ = [] {
    const char* v = std::getenv("PARAVT_PACK_POOL_MB");
    if (v != nullptr) {
      const long long mb = std::atoll(v);
      return static_cast<size_t>(mb > 0 ? mb : 0) << 20;
    }
    // Default: 1/16 of physical memory, at most 4 GiB (1.5 GiB on a 24 GB box, 4 GiB on a
    // training node).
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    const size_t phys = pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
    return std::min(phys / 16, size_t(4096) << 20);
  }();
};

std::mutex& BufferPool::pool_mutex() {
  static std::mutex* mu = new std::mutex();  // leaked with the pool (see pool())
  return *mu;
}

BufferPool& pool() {
  static BufferPool* p = new BufferPool();  // leaked: tensors may die after static teardown
  return *p;
}

}  // namespace

static at::Tensor alloc_output(int64_t N, int64_t D, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const size_t bytes = static_cast<size_t>(N) * static_cast<size_t>(D) * at::elementSize(dtype);
  if (bytes == 0) return at::empty({N, D}, opts);
  size_t got = 0;
  void* ptr = pool().take(bytes, &got);
  return at::from_blob(ptr, {N, D}, [got](void* q) { pool().give(q, got); }, opts);
}

// Writes the packed pixels of `crops_in` (layout L) into outp, (N, 3*tp*p*p) row-major.
// Elem is the raw bit type of the output dtype (uint32_t for float32, uint16_t for bf16/fp16):
// the op is a pure gather from the LUT, so the output dtype is the LUT's and a bf16 LUT gives
// exactly float32_result.to(bfloat16) at half the bytes written.
template <typename Elem>
static void pack_pixels_into(const std::vector<at::Tensor>& crops_in, const at::Tensor& lut_in,
                             int64_t p, int64_t tp, int64_t m, const CropLayout& L, Elem* outp) {
  std::vector<at::Tensor> crops;
  crops.reserve(crops_in.size());
  for (const auto& c : crops_in) crops.push_back(c.contiguous());
  const at::Tensor lut = lut_in.contiguous();
  const int64_t n = static_cast<int64_t>(crops.size());
  const int64_t N = L.patch_offset[n];
  const int64_t D = 3 * tp * p * p;
  std::vector<const uint8_t*> src(n);
  for (int64_t i = 0; i < n; ++i) src[i] = crops[i].data_ptr<uint8_t>();
  const Elem* lutp = static_cast<const Elem*>(lut.data_ptr());
  const int64_t* off = L.patch_offset.data();
  const int64_t pp = p * p, cstride = tp * pp;  // distance between channel blocks of a patch row

  // ~3*tp*p*p floats per patch (6 KiB at p=16): 64 patches per task amortise the scheduling.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t i = std::upper_bound(off, off + n + 1, begin) - off - 1;
    for (int64_t g = begin; g < end; ++g) {
      while (g >= off[i + 1]) ++i;
      const int64_t h = L.grid[3 * i + 1], w = L.grid[3 * i + 2];
      const int64_t T = L.T[i], W = L.W[i];
      const PatchPos pos = patch_position(g - off[i], h, w, m);
      Elem* dst = outp + g * D;
      for (int64_t tpi = 0; tpi < tp; ++tpi) {
        const int64_t f = source_frame(pos.ti, tpi, tp, T);
        const uint8_t* frame = src[i] + f * L.H[i] * W * 3;
        for (int64_t py = 0; py < p; ++py) {
          // One read of the p RGB pixels of this patch row feeds all three channel blocks.
          const uint8_t* row = frame + ((pos.row * p + py) * W + pos.col * p) * 3;
          Elem* d0 = dst + tpi * pp + py * p;
          Elem* d1 = d0 + cstride;
          Elem* d2 = d1 + cstride;
          for (int64_t px = 0; px < p; ++px) {
            d0[px] = lutp[row[3 * px]];
            d1[px] = lutp[256 + row[3 * px + 1]];
            d2[px] = lutp[512 + row[3 * px + 2]];
          }
        }
      }
    }
  });
}

// The affine path: out = (float(v) - mean') / std' per channel, the processor's fused
// rescale+normalise op for op (mean' = mean / rescale, std' = std / rescale, both float32), so
// it is bit-identical to the LUT and to HF, and the compiler vectorises the per-row loop
// (interleaved RGB in, three channel rows out; sub + IEEE div, no FMA: -ffp-contract=off).
// 2-4x faster than the gather on
// AVX-512/AVX2; built for several ISAs and picked at load time (target_clones: x86-64 Linux;
// elsewhere the baseline ISA).
// bf16 output rounds the float32 result to nearest-even, as the LUT's .to(bfloat16) does.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define PARAVT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PARAVT_CLONES
#endif

namespace {

struct Affine {
  float mean[3];
  float std[3];
};

struct PackArgs {
  const CropLayout* L;
  const uint8_t* const* src;
  int64_t n, p, tp, m;
};

static inline uint16_t bf16_rne(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

template <typename Elem>
static inline void affine_range(int64_t begin, int64_t end, const PackArgs& a, const Affine& af,
                                Elem* __restrict outp) {
  const CropLayout& L = *a.L;
  const int64_t p = a.p, tp = a.tp, pp = p * p, cstride = tp * pp, D = 3 * tp * pp;
  const float m0 = af.mean[0], m1 = af.mean[1], m2 = af.mean[2];
  const float s0 = af.std[0], s1 = af.std[1], s2 = af.std[2];
  const int64_t* off = L.patch_offset.data();
  int64_t i = std::upper_bound(off, off + a.n + 1, begin) - off - 1;
  for (int64_t g = begin; g < end; ++g) {
    while (g >= off[i + 1]) ++i;
    const int64_t h = L.grid[3 * i + 1], w = L.grid[3 * i + 2];
    const int64_t T = L.T[i], W = L.W[i];
    const PatchPos pos = patch_position(g - off[i], h, w, a.m);
    Elem* dst = outp + g * D;
    for (int64_t tpi = 0; tpi < tp; ++tpi) {
      const uint8_t* frame = a.src[i] + source_frame(pos.ti, tpi, tp, T) * L.H[i] * W * 3;
      for (int64_t py = 0; py < p; ++py) {
        const uint8_t* __restrict row = frame + ((pos.row * p + py) * W + pos.col * p) * 3;
        Elem* __restrict d0 = dst + tpi * pp + py * p;
        Elem* __restrict d1 = d0 + cstride;
        Elem* __restrict d2 = d1 + cstride;
        for (int64_t px = 0; px < p; ++px) {
          const float r = (static_cast<float>(row[3 * px]) - m0) / s0;
          const float gr = (static_cast<float>(row[3 * px + 1]) - m1) / s1;
          const float b = (static_cast<float>(row[3 * px + 2]) - m2) / s2;
          if constexpr (sizeof(Elem) == 4) {
            d0[px] = r;
            d1[px] = gr;
            d2[px] = b;
          } else {
            d0[px] = bf16_rne(r);
            d1[px] = bf16_rne(gr);
            d2[px] = bf16_rne(b);
          }
        }
      }
    }
  }
}

PARAVT_CLONES static void affine_range_f32(int64_t begin, int64_t end, const PackArgs& a,
                                           const Affine& af, float* outp) {
  affine_range<float>(begin, end, a, af, outp);
}

PARAVT_CLONES static void affine_range_bf16(int64_t begin, int64_t end, const PackArgs& a,
                                            const Affine& af, uint16_t* outp) {
  affine_range<uint16_t>(begin, end, a, af, outp);
}

static void pack_pixels_affine(const std::vector<at::Tensor>& crops_in, const Affine& af,
                               int64_t p, int64_t tp, int64_t m, const CropLayout& L,
                               at::Tensor& out) {
  std::vector<at::Tensor> crops;
  crops.reserve(crops_in.size());
  for (const auto& c : crops_in) crops.push_back(c.contiguous());
  const int64_t n = static_cast<int64_t>(crops.size());
  std::vector<const uint8_t*> src(n);
  for (int64_t i = 0; i < n; ++i) src[i] = crops[i].data_ptr<uint8_t>();
  const PackArgs a{&L, src.data(), n, p, tp, m};
  const bool f32 = out.scalar_type() == at::kFloat;
  void* outp = out.data_ptr();
  at::parallel_for(0, L.patch_offset[n], 64, [&](int64_t begin, int64_t end) {
    if (f32)
      affine_range_f32(begin, end, a, af, static_cast<float*>(outp));
    else
      affine_range_bf16(begin, end, a, af, static_cast<uint16_t*>(outp));
  });
}

// affine = (mean'_0..2, std'_0..2) of the LUT's own arithmetic, or empty for the LUT gather.
// The affine path serves float32 and bfloat16 outputs; float16 always uses the LUT.
static bool use_affine(const std::optional<at::ArrayRef<double>>& affine, at::ScalarType dt,
                       Affine* af) {
  if (!affine.has_value() || dt == at::kHalf) return false;
  TORCH_CHECK(affine->size() == 6, "pack_vision: affine must hold 6 floats (mean'[3], std'[3]), "
              "got ", affine->size(), "; pass None to use the LUT.");
  for (int c = 0; c < 3; ++c) {
    af->mean[c] = static_cast<float>((*affine)[c]);
    af->std[c] = static_cast<float>((*affine)[3 + c]);
    TORCH_CHECK(af->std[c] != 0.0f, "pack_vision: affine std'[", c, "] is 0; use image_std.");
  }
  return true;
}

}  // namespace

static void pack_pixels_dispatch(const std::vector<at::Tensor>& crops, const at::Tensor& lut,
                                 int64_t p, int64_t tp, int64_t m, const CropLayout& L,
                                 at::Tensor& out,
                                 const std::optional<at::ArrayRef<double>>& affine) {
  Affine af;
  if (use_affine(affine, lut.scalar_type(), &af)) {
    pack_pixels_affine(crops, af, p, tp, m, L, out);
    return;
  }
  if (at::elementSize(lut.scalar_type()) == 4)
    pack_pixels_into(crops, lut, p, tp, m, L, static_cast<uint32_t*>(out.data_ptr()));
  else
    pack_pixels_into(crops, lut, p, tp, m, L, static_cast<uint16_t*>(out.data_ptr()));
}

std::tuple<at::Tensor, at::Tensor> pack_pixels_cpu(
    const std::vector<at::Tensor>& crops, const at::Tensor& lut, int64_t p, int64_t tp, int64_t m,
    const std::optional<at::ArrayRef<double>>& affine) {
  const CropLayout L = crop_layout(crops, p, tp, m);
  check_lut(lut, crops[0].device());
  const int64_t n = static_cast<int64_t>(crops.size());
  at::Tensor out = alloc_output(L.patch_offset[n], 3 * tp * p * p, lut.scalar_type());
  pack_pixels_dispatch(crops, lut, p, tp, m, L, out, affine);
  at::Tensor grid = at::from_blob(const_cast<int64_t*>(L.grid.data()), {n, 3}, at::kLong).clone();
  return {out, grid};
}

void pack_pixels_out_cpu(const std::vector<at::Tensor>& crops, const at::Tensor& lut, int64_t p,
                         int64_t tp, int64_t m, const at::Tensor& out,
                         const std::optional<at::ArrayRef<double>>& affine) {
  const CropLayout L = crop_layout(crops, p, tp, m);
  check_lut(lut, crops[0].device());
  const int64_t n = static_cast<int64_t>(crops.size());
  const int64_t N = L.patch_offset[n], D = 3 * tp * p * p;
  TORCH_CHECK(out.scalar_type() == lut.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == N && out.size(1) == D && out.device() == crops[0].device(),
              "pack_pixels_out: out must be a contiguous ", lut.scalar_type(), " (the lut's dtype) (",
              N, ", ", D, ") tensor on ", crops[0].device(), ", got ", out.scalar_type(), " ",
              out.sizes(), " on ", out.device(), "; slice a larger reusable buffer with buf[:N].");
  at::Tensor out_ref = out;
  pack_pixels_dispatch(crops, lut, p, tp, m, L, out_ref, affine);
}

at::Tensor cu_seqlens_host(const std::vector<int64_t>& grid) {
  const int64_t n = static_cast<int64_t>(grid.size() / 3);
  int64_t segments = 0;
  for (int64_t i = 0; i < n; ++i) segments += grid[3 * i];
  at::Tensor cu = at::empty({segments + 1}, at::kInt);
  int32_t* cp = cu.data_ptr<int32_t>();
  int64_t k = 0, acc = 0;
  cp[k++] = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ti = 0; ti < grid[3 * i]; ++ti) {
      acc += grid[3 * i + 1] * grid[3 * i + 2];
      TORCH_CHECK(acc <= INT32_MAX, "pack_vision: ", acc,
                  " patches overflow int32 cu_seqlens; split the batch.");
      cp[k++] = static_cast<int32_t>(acc);
    }
  return cu;
}

std::tuple<at::Tensor, at::Tensor> window_index_host(const std::vector<int64_t>& grid, int64_t m,
                                                     int64_t window_size, int64_t patch_size) {
  const int64_t n = static_cast<int64_t>(grid.size() / 3);
  const int64_t vw = window_size / m / patch_size;
  TORCH_CHECK(vw > 0, "pack_vision: window_size ", window_size,
              " is smaller than merge_size*patch_size = ", m * patch_size,
              "; use the model's vision_config.window_size (112 for Qwen2.5-VL).");
  std::vector<int64_t> tok_off(n + 1, 0), win_off(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = grid[3 * i], lh = grid[3 * i + 1] / m, lw = grid[3 * i + 2] / m;
    tok_off[i + 1] = tok_off[i] + t * lh * lw;
    win_off[i + 1] = win_off[i] + num_windows(t, lh, lw, vw);
  }
  at::Tensor index = at::empty({tok_off[n]}, at::kLong);
  at::Tensor lens = at::empty({win_off[n]}, at::kLong);
  int64_t* ip = index.data_ptr<int64_t>();
  int64_t* lp = lens.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      window_index_crop(grid[3 * i], grid[3 * i + 1] / m, grid[3 * i + 2] / m, vw, tok_off[i],
                        ip + tok_off[i], lp + win_off[i]);
  });
  at::Tensor cu = at::empty({win_off[n] + 1}, at::kInt);
  int32_t* cp = cu.data_ptr<int32_t>();
  cp[0] = 0;
  int64_t acc = 0;
  for (int64_t k = 0; k < win_off[n]; ++k) {
    acc += lp[k] * m * m;
    cp[k + 1] = static_cast<int32_t>(acc);
  }
  return {index, cu};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
vision_metadata_cpu(const at::Tensor& grid_thw, int64_t m, int64_t side, int64_t window_size,
                    int64_t patch_size) {
  TORCH_CHECK(grid_thw.dim() == 2 && grid_thw.size(1) == 3 && grid_thw.device().is_cpu(),
              "vision_metadata: grid_thw must be a CPU (n, 3) integer tensor, got ",
              grid_thw.sizes(), " on ", grid_thw.device(), ".");
  TORCH_CHECK(m > 0, "vision_metadata: merge_size must be positive, got ", m, ".");
  const at::Tensor g64 = grid_thw.to(at::kLong).contiguous();
  const int64_t n = g64.size(0);
  std::vector<int64_t> grid(g64.data_ptr<int64_t>(), g64.data_ptr<int64_t>() + 3 * n);
  std::vector<int64_t> off(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = grid[3 * i], h = grid[3 * i + 1], w = grid[3 * i + 2];
    TORCH_CHECK(t > 0 && h > 0 && w > 0 && h % m == 0 && w % m == 0, "vision_metadata: grid ", i,
                " = (", t, ", ", h, ", ", w, ") must be positive with h and w multiples of ",
                "merge_size ", m, ".");
    off[i + 1] = off[i] + t * h * w;
  }
  const int64_t N = off[n];

  at::Tensor cu = cu_seqlens_host(grid);

  at::Tensor pos = at::empty({N, 2}, at::kLong);
  at::Tensor idx = at::empty({side > 0 ? N : 0, 4}, at::kLong);
  at::Tensor wt = at::empty({side > 0 ? N : 0, 4}, at::kFloat);
  int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* wp = wt.data_ptr<float>();
  const int64_t* offp = off.data();
  at::parallel_for(0, N, 1024, [&](int64_t begin, int64_t end) {
    int64_t i = std::upper_bound(offp, offp + n + 1, begin) - offp - 1;
    for (int64_t g = begin; g < end; ++g) {
      while (g >= offp[i + 1]) ++i;
      const int64_t h = grid[3 * i + 1], w = grid[3 * i + 2];
      const PatchPos ps = patch_position(g - offp[i], h, w, m);
      pp[2 * g] = ps.row;
      pp[2 * g + 1] = ps.col;
      if (side > 0) interp_taps(ps.row, ps.col, h, w, side, ip + 4 * g, wp + 4 * g);
    }
  });

  at::Tensor win_idx = at::empty({0}, at::kLong);
  at::Tensor cu_win = at::empty({0}, at::kInt);
  if (window_size > 0) std::tie(win_idx, cu_win) = window_index_host(grid, m, window_size, patch_size);
  return {cu, pos, idx, wt, win_idx, cu_win};
}

PackOut pack_vision_cpu(const std::vector<at::Tensor>& crops, const at::Tensor& lut,
                        int64_t patch_size, int64_t temporal_patch_size, int64_t merge_size,
                        int64_t num_grid_per_side, int64_t window_size,
                        const std::optional<at::ArrayRef<double>>& affine) {
  auto [pixels, grid] =
      pack_pixels_cpu(crops, lut, patch_size, temporal_patch_size, merge_size, affine);
  auto [cu, pos, idx, wt, win_idx, cu_win] =
      vision_metadata_cpu(grid, merge_size, num_grid_per_side, window_size, patch_size);
  return {pixels, grid, cu, pos, idx, wt, win_idx, cu_win};
}

}  // namespace paravt
