// The kernel's single copy between processes (process_vm_readv) against a
// plain memcpy, from 4 KiB pages and from 2 MiB transparent huge pages: the
// floor under every single-copy transfer (issue 62, docs/benchmarks.md).
//
//   gcc -O2 bench/cma_read.c -o /tmp/cma_read
//   for n in 1048576 2097152 4194304; do /tmp/cma_read $n 0; /tmp/cma_read $n 1; done
//
// argv: bytes, and 1 to ask for huge pages (madvise) on both buffers. A
// child process writes its buffer; the parent reads it 50 times and prints
// the best time, then copies its own buffer 50 times with memcpy.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){
  size_t n = strtoull(argv[1],0,0); int huge = atoi(argv[2]);
  size_t al = 4<<20;
  char* src = mmap(0, n+al, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  src = (char*)(((size_t)src + al-1) & ~(al-1));
  madvise(src, n, huge? MADV_HUGEPAGE: MADV_NOHUGEPAGE);
  char* dst = mmap(0, n+al, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  dst = (char*)(((size_t)dst + al-1) & ~(al-1));
  madvise(dst, n, huge? MADV_HUGEPAGE: MADV_NOHUGEPAGE);
  memset(dst, 2, n);
  int p[2]; pipe(p);
  pid_t c = fork();
  if (c==0){ memset(src,1,n); sleep(100); return 0; }
  usleep(300000);
  // parent reads child's src (same address, COW-copied; touch in child? child inherited; pages shared COW - fine for reading)
  double best=1e9, bestm=1e9;
  for(int i=0;i<50;i++){ struct iovec l={dst,n}, r={src,n}; double t0=now(); ssize_t g=process_vm_readv(c,&l,1,&r,1,0); double t=now()-t0; if(g!=(ssize_t)n){perror("readv");return 1;} if(i>2&&t<best)best=t;}
  for(int i=0;i<50;i++){ double t0=now(); memcpy(dst,src,n); double t=now()-t0; if(i>2&&t<bestm)bestm=t;}
  printf("n=%zu huge=%d cma %.1f us (%.1f GB/s) memcpy %.1f us\n", n, huge, best, n/best/1e3, bestm);
  kill(c,9); wait(0); return 0;
}
