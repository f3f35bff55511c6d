// nccl_raw: an NCCL communicator without LibTorch. The bootstrap that every framework does
// under the hood: rank 0 creates a unique id, every rank receives it (here with MPI_Bcast), each
// calls ncclCommInitRank on its GPU, then one ncclAllReduce whose result is known in closed form
// (rank r contributes r + 1: the sum is W (W + 1) / 2 everywhere), verify, destroy.
//
//   mpirun --allow-run-as-root -np 2 build-gpu/bin/nccl_raw            # one rank per GPU
//   NCCL_DEBUG=INFO mpirun --allow-run-as-root -np 2 build-gpu/bin/nccl_raw --count 1048576
//   build/bin/nccl_raw                                                  # 1 rank (no mpirun)
// Exits 0 when every element is right, 1 when not (or on an NCCL/CUDA error), and 77 (ctest's
// "skipped") when no CUDA device is visible, saying so.
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kExitSkip = 77;

// Every call is checked: an error names the call, the rank and NCCL's / CUDA's own words.
#define CHECK_CUDA(call)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #call, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                            \
    }                                                                                          \
  } while (0)
#define CHECK_NCCL(call)                                                                         \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) {                                                                     \
      std::fprintf(stderr, "rank %d: %s failed: %s\nHINT: rerun with NCCL_DEBUG=INFO\n", g_rank, \
                   #call, ncclGetErrorString(r_));                                               \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
    }                                                                                            \
  } while (0)

int g_rank = 0;

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  size_t count = 1 << 20;  // floats per rank: 4 MiB
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--count") == 0) count = std::strtoull(argv[i + 1], nullptr, 10);
  }

  // 1. A GPU for this rank: the local rank (OpenMPI's, else the global rank) modulo the count.
  int ngpu = 0;
  const cudaError_t probe = cudaGetDeviceCount(&ngpu);
  if (probe != cudaSuccess || ngpu == 0) {
    if (g_rank == 0) {
      std::printf("SKIP: no CUDA device visible (%s); nccl_raw runs on GPU machines only\n",
                  probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices");
    }
    MPI_Finalize();
    return kExitSkip;
  }
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const int device = (local ? std::atoi(local) : g_rank) % ngpu;
  CHECK_CUDA(cudaSetDevice(device));

  // 2. The unique id: made by rank 0, 128 opaque bytes, shared by MPI_Bcast. (torch.distributed
  // does the same through its TCPStore: ProcessGroupNCCL's broadcastUniqueNCCLID.)
  ncclUniqueId id;
  if (g_rank == 0) CHECK_NCCL(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);

  // 3. The communicator: a collective call, every rank must make it.
  const auto t0 = std::chrono::steady_clock::now();
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, world, id, g_rank));
  const double init_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // 4. allreduce SUM of (rank + 1) on (count,) floats, on a stream of our own.
  std::vector<float> host(count, static_cast<float>(g_rank + 1));
  float* buf = nullptr;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_CUDA(cudaMalloc(&buf, count * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(buf, host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  const auto t1 = std::chrono::steady_clock::now();
  CHECK_NCCL(ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, comm, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double ar_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  CHECK_CUDA(cudaMemcpy(host.data(), buf, count * sizeof(float), cudaMemcpyDeviceToHost));

  // 5. Verify against the closed form, count the wrong elements, agree on the total.
  const float expected = world * (world + 1) / 2.0f;
  long wrong = 0;
  for (float v : host) wrong += v != expected;
  long total_wrong = 0;
  MPI_Allreduce(&wrong, &total_wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  int version = 0;
  ncclGetVersion(&version);
  if (g_rank == 0) {
    std::printf(
        "nccl_raw: NCCL %d, %d rank(s), %zu floats: init %.3f s, allreduce %.3f ms "
        "(first call, includes connection setup), expected %.0f, %ld wrong -> %s\n",
        version, world, count, init_s, ar_s * 1e3, expected, total_wrong,
        total_wrong == 0 ? "OK" : "FAILED");
  }

  // 6. Tear down: the communicator first, then the memory.
  CHECK_NCCL(ncclCommDestroy(comm));
  CHECK_CUDA(cudaFree(buf));
  CHECK_CUDA(cudaStreamDestroy(stream));
  MPI_Finalize();
  return total_wrong == 0 ? 0 : 1;
}
