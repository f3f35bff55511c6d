// nccl_raw: an NCCL communicator without LibTorch. The bootstrap that every framework does
// under the hood: rank 0 creates a unique id, every rank receives it, each calls
// ncclCommInitRank on its GPU, then one ncclAllReduce whose result is known in closed form
// (rank r contributes r + 1: the sum is W (W + 1) / 2 everywhere), verify, destroy.
//
// The unique id travels one of two ways:
//   MPI   under mpirun (where built with MPI): MPI_Bcast.
//   file  under torchrun, or by hand: rank 0 writes the 128 bytes to a file that every rank
//         reads (one machine, or a shared file system). Rank and world size come from torchrun's
//         RANK / WORLD_SIZE / LOCAL_RANK, or --rank / --world. (torch.distributed does the same
//         through its TCPStore: ProcessGroupNCCL's broadcastUniqueNCCLID.)
//
//   mpirun --allow-run-as-root -np 2 build-gpu/bin/nccl_raw            # one rank per GPU
//   torchrun --standalone --nproc_per_node=2 --no_python build-gpu/bin/nccl_raw
//   NCCL_DEBUG=INFO build/bin/nccl_raw --count 1048576                   # 1 rank
// Exits 0 when every element is right, 1 when not (or on an NCCL/CUDA error), 2 on bad
// arguments, and 77 (ctest's "skipped") when no CUDA device is visible, saying so.
#include <cuda_runtime_api.h>
#include <nccl.h>
#ifdef DTC_NCCL_RAW_MPI
#include <mpi.h>
#endif

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kExitSkip = 77;
int g_rank = 0;
bool g_mpi = false;

[[noreturn]] void fail() {
#ifdef DTC_NCCL_RAW_MPI
  if (g_mpi) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::exit(1);
}

// Every call is checked: an error names the call, the rank and NCCL's / CUDA's own words.
#define CHECK_CUDA(call)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #call, cudaGetErrorString(e_)); \
      fail();                                                                                  \
    }                                                                                          \
  } while (0)
#define CHECK_NCCL(call)                                                                         \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) {                                                                     \
      std::fprintf(stderr, "rank %d: %s failed: %s\nHINT: rerun with NCCL_DEBUG=INFO\n", g_rank, \
                   #call, ncclGetErrorString(r_));                                               \
      fail();                                                                                    \
    }                                                                                            \
  } while (0)

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr,
               "nccl_raw: %s\nusage: nccl_raw [--count N] [--rank R --world W] [--id-file PATH] "
               "[--id-timeout S]\n",
               what.c_str());
  std::exit(2);
}

// The file exchange: rank 0 writes PATH.tmp and renames it to PATH (a reader sees all 128 bytes
// or nothing); the others poll for PATH until the timeout.
void share_id_by_file(ncclUniqueId& id, const std::string& path, double timeout_s) {
  if (g_rank == 0) {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(&id), sizeof(id));
      if (!f) {
        std::fprintf(stderr,
                     "rank 0: cannot write the unique id to %s\nHINT: pass --id-file "
                     "with a writable path that every rank can read\n",
                     tmp.c_str());
        fail();
      }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::fprintf(stderr, "rank 0: cannot rename %s to %s\n", tmp.c_str(), path.c_str());
      fail();
    }
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f.read(reinterpret_cast<char*>(&id), sizeof(id))) return;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr,
                   "rank %d: no unique id in %s after %.0f s: rank 0 never wrote it\nHINT: start "
                   "every rank with the same --id-file (torchrun: the same run), and rank 0 too\n",
                   g_rank, path.c_str(), timeout_s);
      fail();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t count = 1 << 20;  // floats per rank: 4 MiB
  int rank = env_int("RANK", -1);
  int world = env_int("WORLD_SIZE", -1);
  int local_rank = env_int("LOCAL_RANK", -1);
  double id_timeout_s = 120;
  std::string id_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage_error("'" + a + "' needs a value (or is unknown)");
    const char* v = argv[++i];
    if (a == "--count") {
      count = std::strtoull(v, nullptr, 10);
    } else if (a == "--rank") {
      rank = std::atoi(v);
    } else if (a == "--world") {
      world = std::atoi(v);
    } else if (a == "--id-file") {
      id_file = v;
    } else if (a == "--id-timeout") {
      id_timeout_s = std::atof(v);
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (count == 0) usage_error("--count must be at least 1");

#ifdef DTC_NCCL_RAW_MPI
  // Under mpirun (OpenMPI, MPICH, Slurm's PMI set these), MPI gives rank, size and the exchange.
  g_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
  if (g_mpi) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("MPI_LOCALRANKID", rank));
  }
#endif
  if (world < 0) world = 1;
  if (rank < 0) rank = 0;
  if (world < 1 || rank >= world) {
    usage_error("rank " + std::to_string(rank) + " of world " + std::to_string(world) +
                ": need 0 <= rank < world");
  }
  if (local_rank < 0) local_rank = rank;
  g_rank = rank;
  if (id_file.empty()) {
    // One name per run: torchrun's run id (a fresh uuid with --standalone), else its port.
    const char* run = std::getenv("TORCHELASTIC_RUN_ID");
    const char* port = std::getenv("MASTER_PORT");
    const char* tmp = std::getenv("TMPDIR");
    id_file = std::string(tmp != nullptr ? tmp : "/tmp") + "/nccl_raw-" +
              (run != nullptr    ? run
               : port != nullptr ? port
                                 : "local") +
              ".id";
  }

  // 1. A GPU for this rank: the local rank modulo the count. Several ranks on one GPU: NCCL
  // refuses ("Duplicate GPU detected"), so world <= GPUs on one machine.
  int ngpu = 0;
  const cudaError_t probe = cudaGetDeviceCount(&ngpu);
  if (probe != cudaSuccess || ngpu == 0) {
    if (rank == 0) {
      std::printf("SKIP: no CUDA device visible (%s); nccl_raw runs on GPU machines only\n",
                  probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices");
    }
#ifdef DTC_NCCL_RAW_MPI
    if (g_mpi) MPI_Finalize();
#endif
    return kExitSkip;
  }
  const int device = local_rank % ngpu;
  CHECK_CUDA(cudaSetDevice(device));

  // 2. The unique id: made by rank 0, 128 opaque bytes, shared with every rank.
  ncclUniqueId id;
  if (rank == 0) CHECK_NCCL(ncclGetUniqueId(&id));
  const char* how = "none (1 rank)";
  if (g_mpi) {
#ifdef DTC_NCCL_RAW_MPI
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    how = "MPI_Bcast";
#endif
  } else if (world > 1) {
    share_id_by_file(id, id_file, id_timeout_s);
    how = "file";
  }

  // 3. The communicator: a collective call, every rank must make it.
  const auto t0 = std::chrono::steady_clock::now();
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, world, id, rank));
  const double init_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0 && !g_mpi && world > 1) std::remove(id_file.c_str());  // all have joined

  // 4. allreduce SUM of (rank + 1) on (count,) floats, on a stream of our own.
  std::vector<float> host(count, static_cast<float>(rank + 1));
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

  // 5. Verify against the closed form, count the wrong elements, agree on the total (one more
  // allreduce, of one int64, through the same communicator).
  const float expected = static_cast<float>(world) * (world + 1) / 2.0f;
  int64_t wrong = 0;
  for (float v : host) wrong += v != expected;
  int64_t* dwrong = nullptr;
  int64_t total_wrong = 0;
  CHECK_CUDA(cudaMalloc(&dwrong, sizeof(int64_t)));
  CHECK_CUDA(cudaMemcpy(dwrong, &wrong, sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK_NCCL(ncclAllReduce(dwrong, dwrong, 1, ncclInt64, ncclSum, comm, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaMemcpy(&total_wrong, dwrong, sizeof(int64_t), cudaMemcpyDeviceToHost));
  int version = 0;
  ncclGetVersion(&version);
  if (rank == 0) {
    std::printf(
        "nccl_raw: NCCL %d, %d rank(s), id by %s, %zu floats: init %.3f s, allreduce %.3f ms "
        "(first call, includes connection setup), expected %.0f, %lld wrong -> %s\n",
        version, world, how, count, init_s, ar_s * 1e3, expected,
        static_cast<long long>(total_wrong), total_wrong == 0 ? "OK" : "FAILED");
  }

  // 6. Tear down: the communicator first, then the memory.
  CHECK_NCCL(ncclCommDestroy(comm));
  CHECK_CUDA(cudaFree(dwrong));
  CHECK_CUDA(cudaFree(buf));
  CHECK_CUDA(cudaStreamDestroy(stream));
#ifdef DTC_NCCL_RAW_MPI
  if (g_mpi) MPI_Finalize();
#endif
  return total_wrong == 0 ? 0 : 1;
}
