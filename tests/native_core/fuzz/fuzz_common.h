// fuzz_common.h: what the libFuzzer targets of the torch-free cores share (one target per entry
// point: fuzz_*.cpp here, built and run by mla_backend/testing/fuzz_cores.py at every x86 ISA
// level with -fsanitize=fuzzer,address,undefined).
//
// Each target decodes its input with FuzzedDataProvider into the entry point's dims, lengths,
// block tables, slots and indices (valid or malformed: what the op layer in the kernels' .cpp
// files would pass, plus the malformed values the core claims to check itself), fills the bulk
// values from a PRNG seeded by the input (finite, or with NaN / inf sprinkled in), runs the core
// and checks:
//   * the sanitizers: inputs are allocated at exactly their size, so a read or write outside
//     one is an ASan report; UBSan stops at its first report;
//   * no write outside the outputs: every input is compared with its copy after the call,
//     padding between an output's strided rows is a canary pattern checked after the call, and
//     a refused call leaves every output untouched;
//   * refusal exactly when the harness's own reading of the documented rules says the call is
//     malformed (no silent acceptance, no false refusal);
//   * where the call is valid and its values finite: the result equals a scalar fp64
//     reference written here (independently of the kernels: its own bf16 / fp16 / e4m3
//     conversions) within a tolerance stated at each check.
// A failed check prints what differs and aborts (libFuzzer keeps the input as a crash).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#define MLA_CORE_ONLY 1

namespace fz {

[[noreturn]] inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "FUZZ CHECK FAILED: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::abort();
}
#define FZ_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) ::fz::fail(__VA_ARGS__); \
  } while (0)

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- a PRNG for bulk values (seeded from the input) -----------------------------------------
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed ^ 0x9E3779B97F4A7C15ull) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // uniform in [lo, hi]
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1)); }
  // a value in [-a, a] on a grid of 1/64 (small ints and halves are common)
  float val(float a) {
    const int64_t steps = static_cast<int64_t>(a * 64);
    return static_cast<float>(range(-steps, steps)) / 64.0f;
  }
};

// A non-finite or extreme value.
inline float special(Rng& g) {
  static const float v[] = {kNaN, kInf, -kInf, 3.0e38f, -3.0e38f, 1e-40f, -0.0f, 65504.0f, 1e6f};
  return v[g.next() % (sizeof(v) / sizeof(v[0]))];
}

// ---- independent scalar conversions (the reference's, not the kernels') -------------------
inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bf16_f(uint16_t h) { return bits_f(static_cast<uint32_t>(h) << 16); }
inline uint16_t f_bf16(float f) {  // round to nearest even
  const uint32_t u = f_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline float f16_f(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 0) v = std::ldexp(static_cast<float>(m), -24);
  else if (e == 31) v = m ? kNaN : kInf;
  else v = std::ldexp(static_cast<float>(m | 1024), e - 25);
  return s ? -v : v;
}
inline uint16_t f_f16(float f) {  // round to nearest even, overflow to inf
  if (std::isnan(f)) return 0x7E00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14))  // subnormal grid 2^-24 (1024 steps reach the least normal)
    return sign | static_cast<uint16_t>(std::nearbyint(a * std::ldexp(1.0, 24)));
  int e;
  std::frexp(a, &e);  // a = x 2^e, x in [0.5, 1): exponent e - 1, ulp 2^(e - 11)
  const double n = std::nearbyint(std::ldexp(a, 11 - e));  // in [1024, 2048], ties to even
  const int64_t bits = (static_cast<int64_t>(e - 1 + 15) << 10) + static_cast<int64_t>(n) - 1024;
  return sign | static_cast<uint16_t>(bits >= 0x7C00 ? 0x7C00 : bits);
}
// float8_e4m3fn: bias 7, no inf, 0x7F / 0xFF NaN
inline float e4m3_f(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return kNaN;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(m | 8), e - 10);
  return s ? -v : v;
}
// nearest e4m3 to x (|x| <= 448), ties to the even code; NaN -> 0x7F (positive codes 0 .. 0x7E
// increase with their value: a binary search)
inline uint8_t f_e4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  int lo = 0, hi = 0x7E;  // e4m3_f(lo) <= a < e4m3_f(hi), or a at an end
  if (a >= e4m3_f(0x7E)) return sign | 0x7E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (e4m3_f(static_cast<uint8_t>(mid)) <= a ? lo : hi) = mid;
  }
  const float dl = a - e4m3_f(static_cast<uint8_t>(lo)), dh = e4m3_f(static_cast<uint8_t>(hi)) - a;
  const int c = dl < dh ? lo : (dh < dl ? hi : (lo % 2 == 0 ? lo : hi));
  return sign | static_cast<uint8_t>(c);
}

// ---- buffers --------------------------------------------------------------------------------
// Bytes of an input, with a copy to check that the call left it untouched.
struct Frozen {
  std::vector<uint8_t> copy;
  const void* p = nullptr;
  size_t n = 0;
  const char* name = "";
  void take(const void* ptr, size_t bytes, const char* what) {
    p = ptr, n = bytes, name = what;
    copy.assign(static_cast<const uint8_t*>(ptr), static_cast<const uint8_t*>(ptr) + bytes);
  }
  void check() const {
    if (n && std::memcmp(copy.data(), p, n) != 0) fail("input %s was written by the call", name);
  }
};

// A canary byte pattern.
constexpr uint8_t kCanary = 0xA7;

// ---- threads ---------------------------------------------------------------------------------
template <class Par>
Par make_parallel(int64_t threads) {
  Par par;
  par.threads = std::max<int64_t>(1, threads);
  if (par.threads > 1)
    par.for_range = [t = par.threads](int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
      const int64_t k = std::min(t, n);
      std::vector<std::thread> pool;
      for (int64_t c = 1; c < k; ++c) pool.emplace_back(fn, n * c / k, n * (c + 1) / k);
      if (k > 0) fn(0, n / k);
      for (auto& th : pool) th.join();
    };
  return par;
}

// items [0, n) over `threads` contiguous chunks
inline void for_items(int64_t n, int64_t threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t k = std::min<int64_t>(std::max<int64_t>(threads, 1), n);
  std::vector<std::thread> pool;
  for (int64_t c = 1; c < k; ++c) pool.emplace_back(fn, n * c / k, n * (c + 1) / k);
  fn(0, n / k);
  for (auto& th : pool) th.join();
}

// ---- storage dtypes of the cores (0 bf16, 1 fp16, 2 fp32) -----------------------------------
inline int64_t dt_size(int dt) { return dt == 2 ? 4 : 2; }
// the stored value of x in dtype dt at p
inline void put(uint8_t* p, int dt, float x) {
  if (dt == 0) {
    const uint16_t h = f_bf16(x);
    std::memcpy(p, &h, 2);
  } else if (dt == 1) {
    const uint16_t h = f_f16(x);
    std::memcpy(p, &h, 2);
  } else {
    std::memcpy(p, &x, 4);
  }
}
inline double get(const uint8_t* p, int dt) {
  if (dt == 2) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dt == 0 ? bf16_f(h) : f16_f(h);
}
// relative precision of dtype dt's rounding
inline double dt_eps(int dt) { return dt == 0 ? 1.0 / 256 : (dt == 1 ? 1.0 / 2048 : 1e-6); }

}  // namespace fz
