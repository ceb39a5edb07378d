// amx_tiles.h: the AMX tile plumbing shared by the native kernels that use AMX-BF16 tiles
// (gemm_core.h's GEMM, amx_attention.h's absorbed attention). Plain C++, no torch includes;
// everything here exists only in builds with MLA_HAS_AMX (level amx: -mamx-tile -mamx-bf16).
//
//   amx_request_permission()  whether the OS lets this process use tiles (Linux: one
//                             arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) per process; torch
//                             asks too); tiles must not be touched when it says false.
//   amx_configure()           palette 1, all 8 tiles 16 rows x 64 bytes: a C tile is 16 x 16
//                             fp32, an A tile 16 rows x 32 bf16, a B tile 16 bf16 pairs x 16
//                             columns (VNNI). Called at the start of each kernel call: other code
//                             in the thread (oneDNN) may have configured the tiles differently.
#pragma once

#if defined(MLA_HAS_AMX)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mla_amx {

inline bool amx_request_permission() {
#if defined(__linux__)
  static const bool ok = [] {
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtileData = 18;
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) != 0) return false;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
    return (bitmask & (1ul << kXtileData)) != 0;
  }();
  return ok;
#else
  return false;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace mla_amx
#endif  // MLA_HAS_AMX
