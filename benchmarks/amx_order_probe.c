// Which fp32 order does AMX's TDPBF16PS follow? bik's CPU matmul defines one fp32 chain per
// output over ascending K (acc += a[k] * b[k], one rounding per product; bf16 products are
// exact in fp32); an AMX path could serve bik only if the tile instruction reproduced such an
// order. Compares a 16 x 16 tile of C = A @ B (K = 32 x KT, A's magnitudes spread over
// 1e-3 to 1e5) with: the ascending chain, the chain with each pair's odd product first, and
// acc + the exact sum of each group of 1-32 products with one rounding per group.
// Build and run on a CPU with AMX-BF16 (Linux asks for the tile state with arch_prctl):
//   gcc -O2 -mamx-tile -mamx-bf16 -ffp-contract=off -o amx_order_probe amx_order_probe.c -lm
//   ./amx_order_probe 4
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static double rnd(void) { return (rand() / (double)RAND_MAX) * 2 - 1; }
int main(int argc, char **argv) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { puts("no AMX permission"); return 1; }
  int KT = argc > 1 ? atoi(argv[1]) : 4;  // K = 32 * KT
  int same_g[6] = {0}; int K = 32 * KT, trials = 200, same_asc = 0, same_odd = 0, same_pairsum = 0, total = 0;
  static uint16_t A[16 * 32 * 64], B[16 * 32 * 64], Bp[16 * 32 * 64];
  static float C[16 * 16];
  cfg_t cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
  cfg.rows[0] = 16; cfg.colsb[0] = 64;   // C: 16 x 16 fp32
  cfg.rows[1] = 16; cfg.colsb[1] = 64;   // A: 16 rows x 32 bf16
  cfg.rows[2] = 16; cfg.colsb[2] = 64;   // B: 16 pair-rows x 16 cols x 2
  _tile_loadconfig(&cfg);
  for (int t = 0; t < trials; t++) {
    double scale = pow(10, (t % 7) - 3);
    for (int i = 0; i < 16 * K; i++) A[i] = tobf(rnd() * scale * (1 + 100 * (rand() % 10 == 0)));
    for (int i = 0; i < K * 16; i++) B[i] = tobf(rnd());   // B[k][n], row-major K x 16
    for (int k = 0; k < K / 2; k++) for (int n = 0; n < 16; n++) {
      Bp[(k * 16 + n) * 2 + 0] = B[(2 * k) * 16 + n];
      Bp[(k * 16 + n) * 2 + 1] = B[(2 * k + 1) * 16 + n];
    }
    _tile_zero(0);
    for (int kt = 0; kt < KT; kt++) {
      _tile_loadd(1, A + kt * 32, K * 2);                 // rows of A: stride K bf16
      _tile_loadd(2, Bp + kt * 16 * 32, 64);              // 16 pair-rows of 64 bytes
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, C, 64);
    for (int m = 0; m < 16; m++) for (int n = 0; n < 16; n++) {
      float asc = 0, odd = 0, ps = 0, g[6] = {0};
      for (int gi = 0; gi < 6; gi++) { int G = 1 << gi; for (int k0 = 0; k0 < K; k0 += G) { double d = g[gi];
        for (int k = k0; k < k0 + G; k++) d += (double)bf(A[m * K + k]) * bf(B[k * 16 + n]);
        g[gi] = (float)d; } if (g[gi] == C[m * 16 + n]) same_g[gi]++; }
      for (int k = 0; k < K; k += 2) {
        float p0 = bf(A[m * K + k]) * bf(B[k * 16 + n]), p1 = bf(A[m * K + k + 1]) * bf(B[(k + 1) * 16 + n]);
        asc = asc + p0; asc = asc + p1;
        odd = odd + p1; odd = odd + p0;
        ps = ps + (float)((double)p0 + (double)p1);
      }
      float c = C[m * 16 + n];
      same_asc += c == asc; same_odd += c == odd; same_pairsum += c == ps; total++;
    }
  }
  _tile_release();
  printf("K=%d: equal to ascending chain %d/%d, odd-first %d/%d, exact pair sum then add %d/%d\n", K, same_asc, total, same_odd, total, same_pairsum, total);
  for (int gi = 0; gi < 6; gi++) printf("  acc + exact sum of groups of %d, one rounding per group: %d/%d\n", 1 << gi, same_g[gi], total);
  return 0;
}
