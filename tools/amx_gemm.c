/*
 * The AMX linear layers (bulkgen/engine/cpu/csrc/amx.c) alone: ms a call and TFLOP/s, best of 8, random bfloat16
 * weights and inputs, with a spot check against a float32 sum (BENCHMARKS.md, issue 38).
 *
 *   gcc -O3 -march=native -fopenmp -DSRC='"bulkgen/engine/cpu/csrc/amx.c"' -I. -Ibulkgen/engine/cpu/csrc \
 *       tools/amx_gemm.c -o /tmp/amx_gemm -lm
 *   /tmp/amx_gemm N K ROWS THREADS [GATED 0|1] [COPIES]      # COPIES > 1 cycles weights from DRAM
 *
 * GATED: linear_silu_mul_amx with N outputs (gate and up weights of N x K each).
 */
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <omp.h>
#include SRC
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint16_t rb(void){float f=((rand()%2001)-1000)*1e-4f;return f32_to_bf16(f);}
int main(int argc,char**argv){
  int64_t N=atoll(argv[1]),K=atoll(argv[2]),M=atoll(argv[3]);int th=atoi(argv[4]);int silu=argc>5?atoi(argv[5]):0;
  int copies=argc>6?atoi(argv[6]):1;
  amx_available();
  int64_t nw=silu?2*N:N; int64_t ps=amx_packed_size(N,K);
  uint16_t*w=malloc(nw*K*2);for(int64_t i=0;i<nw*K;i++)w[i]=rb();
  uint16_t**p=malloc(sizeof(void*)*copies);
  for(int c=0;c<copies;c++){p[c]=aligned_alloc(64,(silu?2:1)*ps*2);pack_linear_amx(w,N,K,p[c],th);if(silu)pack_linear_amx(w+N*K,N,K,p[c]+ps,th);}
  uint16_t*x=malloc(M*K*2);for(int64_t i=0;i<M*K;i++)x[i]=rb();
  uint16_t*y=aligned_alloc(64,M*N*2+64);
  double best=1e9;
  for(int r=0;r<8;r++){double t0=now();for(int c=0;c<copies;c++){if(silu)linear_silu_mul_amx(x,M,K,p[c],N,y,th);else linear_amx(x,M,K,p[c],N,0,y,th);}double t=(now()-t0)/copies;if(t<best)best=t;}
  double fl=2.0*M*nw*K;
  /* checksum vs reference for a few entries */
  double err=0;for(int t=0;t<64;t++){int64_t m=rand()%M,n=rand()%N;float s=0,s2=0;for(int64_t k=0;k<K;k++){s+=bf16_to_f32(x[m*K+k])*bf16_to_f32(w[n*K+k]);if(silu)s2+=bf16_to_f32(x[m*K+k])*bf16_to_f32(w[(N+n)*K+k]);}
    float ref=silu? (s/(1+expf(-s)))*s2 : s; float got=bf16_to_f32(y[m*N+n]); double e=fabs(got-ref)/(fabs(ref)+1e-3); if(e>err)err=e;}
  printf("N=%ld K=%ld M=%ld th=%d silu=%d: %.3f ms %.2f TF/s relerr %.3g\n",N,K,M,th,silu,best*1e3,fl/best/1e12,err);
}
