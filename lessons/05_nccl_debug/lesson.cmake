# Lesson 05: NCCL and communication debugging. The exercise is debug_aids.cpp (the "who is
# missing" barrier and collective fingerprints) and nccl_reading.cpp (the transport between two
# ranks and why; NCCL's choice of interface); the doctor, the fault lab and the NCCL log parser are
# given (driver).
dtc_add_lesson(05 DIR 05_nccl_debug SOURCES debug_aids.cpp nccl_reading.cpp flight_recorder.cpp
               DRIVER debug_given.cpp doctor.cpp flight_recorder_given.cpp nccl_log.cpp program.cpp
               TESTS tests/lesson05/debug_aids_test.cpp tests/lesson05/given_test.cpp
                     tests/lesson05/nccl_reading_test.cpp tests/lesson05/flight_recorder_test.cpp
               LIBS dtc::dist TORCH)

# The fault lab end to end, on 2 real processes under this path's torchrun: each faulty case
# must fail (exit 1) with its diagnosis, the healthy one pass (exit 0). The program's own
# timeouts are 3 s; a hang is killed by the runner.
if(DTC_TORCHRUN)
  set(l05_fault ${DTC_E2E_RUN} --nproc 2 --program @PROGRAM@)
  dtc_add_e2e(05 NAME fault.skip-collective TIMEOUT 60 COMMAND ${l05_fault} --exit 1
    --output "DIAGNOSIS: collective #0 differs across ranks" -- --timeout-ms 3000 fault
    --case skip-collective)
  dtc_add_e2e(05 NAME fault.shape-mismatch TIMEOUT 60 COMMAND ${l05_fault} --exit 1
    --output "rank\\(s\\) 1: #0 allreduce\\(Float\\[8\\]\\)" -- --timeout-ms 3000 fault
    --case shape-mismatch)
  dtc_add_e2e(05 NAME fault.wrong-world-size TIMEOUT 60 COMMAND ${l05_fault} --exit 1
    --output "rank\\(s\\) 2 of 3 never arrived.*only 2 started" -- --timeout-ms 3000 fault
    --case wrong-world-size)
  dtc_add_e2e(05 NAME fault.missing-rank TIMEOUT 60 COMMAND ${l05_fault} --exit 1
    --output "DIAGNOSIS: barrier 'start': rank\\(s\\) 1 of 2 never arrived" --
    --timeout-ms 3000 fault --case missing-rank)
  # PyTorch's own who-is-missing barrier (gloo's monitoredBarrier) names the rank that never came.
  dtc_add_e2e(05 NAME fault.stuck-rank TIMEOUT 60 COMMAND ${l05_fault} --exit 1
    --output "DIAGNOSIS: monitoredBarrier: .*Ranks? 1 failed to pass monitoredBarrier" --
    --timeout-ms 3000 fault --case stuck-rank)
  # The Flight Recorder's dumps of a real hang, read by your analyze_flight_recorder (skips where
  # LibTorch has no Flight Recorder for gloo: 1.13).
  dtc_add_e2e(05 NAME fault.flight-recorder TIMEOUT 120 SKIP_RETURN_CODE 77 COMMAND
    Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson05/fr_e2e.py" --torchrun
    "${DTC_TORCHRUN}" "--torchrun-flags=${_dtc_e2e_flags}" --program @PROGRAM@)
  dtc_add_e2e(05 NAME fault.none TIMEOUT 60 COMMAND ${l05_fault} --exit 0
    --output "2 ranks: barrier passed, 2 collectives matched" -- --timeout-ms 3000 fault
    --case none)
endif()

# Your nccl_reading.cpp through the program, one process each (no launcher): the transport
# between two ranks of a sample log and the variables behind it, and NCCL's choice of interface
# on a made-up list. The variables they read are set here (env -u: none inherited from the shell).
set(l05_read env -u NCCL_SOCKET_IFNAME -u NCCL_P2P_DISABLE -u NCCL_SHM_DISABLE -u NCCL_P2P_LEVEL
    -u NCCL_IB_DISABLE -u NCCL_NET -u NCCL_NET_GDR_LEVEL)
set(l05_e2e "${Python3_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/tests/support/e2e_run.py" --nproc 0
    --program @PROGRAM@)
set(l05_data "${PROJECT_SOURCE_DIR}/tests/lesson05/data")
dtc_add_e2e(05 NAME nccl-log.link-sockets-on-one-node TIMEOUT 60 COMMAND ${l05_read}
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 ${l05_e2e} --exit 1 --json-equals family=\"NET/Socket\"
  --json-equals same_node=true --json-equals healthy=false
  "--json-equals=variables=[\"NCCL_P2P_DISABLE\",\"NCCL_SHM_DISABLE\"]"
  -- nccl-log "${l05_data}/nccl_1node_2gpu_socket.log" --link 0 1 --json)
dtc_add_e2e(05 NAME nccl-log.link-infiniband TIMEOUT 60 COMMAND ${l05_read} ${l05_e2e} --exit 0
  --json-equals family=\"NET/IB\" --json-equals gpu_direct=true --json-equals same_node=false
  --json-equals healthy=true -- nccl-log "${l05_data}/nccl_2node_4gpu_ib.log" --link 3 0 --json)
dtc_add_e2e(05 NAME interfaces.prefix-takes-the-vlan TIMEOUT 60 COMMAND ${l05_read}
  NCCL_SOCKET_IFNAME=eth0 ${l05_e2e} --exit 1 "--json-equals=picked=[\"eth0\",\"eth0.100\"]"
  --json-equals ok=false -- interfaces --interfaces lo,eth0,eth0.100 --cluster eth0 --json)
dtc_add_e2e(05 NAME interfaces.exact-name TIMEOUT 60 COMMAND ${l05_read} NCCL_SOCKET_IFNAME==eth0
  ${l05_e2e} --exit 0 "--json-equals=picked=[\"eth0\"]" --json-equals ok=true -- interfaces
  --interfaces lo,eth0,eth0.100 --cluster eth0 --json)

# gpu_mfu (bench/gpu_mfu.cpp): MFU of the course's GPT; on a CPU machine only its smoke run.
add_executable(gpu_mfu "${PROJECT_SOURCE_DIR}/bench/gpu_mfu.cpp")
target_link_libraries(gpu_mfu PRIVATE dtc::dist)
target_compile_options(gpu_mfu PRIVATE ${DTC_WARNINGS})
dtc_use_torch_pch(gpu_mfu)
add_test(NAME lesson05.solution.gpu_mfu_smoke
  COMMAND ${DTC_E2E_RUN} --nproc 0 --program $<TARGET_FILE:gpu_mfu> --json-positive tokens_per_s
          --json-positive achieved_tflops --json-positive params -- --smoke --device cpu --json)
set_tests_properties(lesson05.solution.gpu_mfu_smoke PROPERTIES
  LABELS "lesson05;solution;lesson05-solution" TIMEOUT 60)
# On a GPU: the real size (label gpu: scripts/gpu-check.sh runs `ctest -L gpu`).
# Without a GPU it skips (77), saying why.
add_test(NAME lesson05.gpu.gpu_mfu
  COMMAND gpu_mfu --device cuda --skip-without-gpu --steps 5 --warmup 2 --json)
set_tests_properties(lesson05.gpu.gpu_mfu PROPERTIES LABELS "lesson05;gpu" TIMEOUT 300
  SKIP_RETURN_CODE 77)

# nccl_raw: NCCL without LibTorch (CUDA runtime + nccl.h + libnccl; MPI optional). Built where the
# CUDA toolkit, nccl.h and libnccl are found (the primary path's wheel ships NCCL; the light path
# usually has none); its test skips (77) where no GPU is visible. With MPI it also runs under
# mpirun; without, its ranks share NCCL's unique id through a file (torchrun, or by hand).
find_package(CUDAToolkit QUIET)
find_package(MPI QUIET COMPONENTS CXX)
# nccl.h and libnccl from one place: the wheel's nvidia/nccl (as DtcTorch.cmake finds it) first,
# else the CUDA toolkit's or the system's. (libnccl.so.2 has no unversioned link in the wheel.)
set(DTC_L05_NCCL_INCLUDE "")
set(DTC_L05_NCCL_LIB "")
foreach(_root "${DTC_TORCH_ROOT}/../nvidia/nccl" "$ENV{CUDA_HOME}" /usr/local/cuda /usr)
  foreach(_lib lib/libnccl.so.2 lib/libnccl.so lib64/libnccl.so.2 lib64/libnccl.so
               lib/x86_64-linux-gnu/libnccl.so.2)
    if(NOT DTC_L05_NCCL_LIB AND EXISTS "${_root}/include/nccl.h" AND EXISTS "${_root}/${_lib}")
      get_filename_component(DTC_L05_NCCL_INCLUDE "${_root}/include" ABSOLUTE)
      get_filename_component(DTC_L05_NCCL_LIB "${_root}/${_lib}" ABSOLUTE)
    endif()
  endforeach()
endforeach()
if(CUDAToolkit_FOUND AND DTC_L05_NCCL_INCLUDE AND DTC_L05_NCCL_LIB)
  add_executable(nccl_raw "${PROJECT_SOURCE_DIR}/lessons/05_nccl_debug/nccl_raw.cpp")
  target_include_directories(nccl_raw SYSTEM PRIVATE "${DTC_L05_NCCL_INCLUDE}")
  target_link_libraries(nccl_raw PRIVATE CUDA::cudart "${DTC_L05_NCCL_LIB}")
  if(MPI_CXX_FOUND)
    target_link_libraries(nccl_raw PRIVATE MPI::MPI_CXX)
    target_compile_definitions(nccl_raw PRIVATE DTC_NCCL_RAW_MPI)
  endif()
  target_compile_options(nccl_raw PRIVATE ${DTC_WARNINGS})
  get_filename_component(_l05_nccl_libdir "${DTC_L05_NCCL_LIB}" DIRECTORY)
  set_target_properties(nccl_raw PROPERTIES BUILD_RPATH "${_l05_nccl_libdir}")
  add_test(NAME lesson05.solution.nccl_raw COMMAND nccl_raw --count 1024)
  set_tests_properties(lesson05.solution.nccl_raw PROPERTIES SKIP_RETURN_CODE 77
    LABELS "lesson05;solution;lesson05-solution;gpu" TIMEOUT 60)
  message(STATUS "lesson05: nccl_raw enabled (NCCL ${DTC_L05_NCCL_LIB}, MPI ${MPI_CXX_FOUND})")
else()
  message(STATUS "lesson05: nccl_raw not built (CUDA toolkit ${CUDAToolkit_FOUND}, "
                 "nccl.h '${DTC_L05_NCCL_INCLUDE}', libnccl '${DTC_L05_NCCL_LIB}')")
endif()
