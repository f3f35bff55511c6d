# Finds LibTorch and describes it as two interface targets:
#   dtc_torch  LibTorch + c10d (gloo always; NCCL when LibTorch is a CUDA build)
#   dtc_fmt    the fmt headers that match this build
#
# Two generations are supported (see README, "Two LibTorch paths"):
#   primary  PyPI's torch 2.x wheel: CMAKE_PREFIX_PATH="<torch>/share/cmake;<torch>"
#   light    Debian's libtorch-dev 1.13: plain find_package(Torch)

# The wheel's CMake config looks for the CUDA toolkit; it only needs to find it, nothing here
# runs on a GPU. Silence its complaint about CMAKE_CUDA_ARCHITECTURES.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING "GPU architectures for CUDA code (H100/H200: 9.0)")
endif()

# The wheel is a CUDA build, and its TorchConfig insists on a CUDA toolkit (nvcc) to describe the
# CUDA runtime it links (public/cuda.cmake, then a FATAL_ERROR). A laptop or a fresh Debian has
# no toolkit, and needs none: the wheel brings the CUDA runtime and its headers itself
# (site-packages/nvidia/cu*/{lib,include}). Where no toolkit is found, describe the runtime from
# those as torch::cudart; TorchConfig's CUDA probe then stands down (it returns when that target
# exists). DTC_WHEEL_CUDA_RUNTIME=ON forces this path (to test it on a machine with a toolkit).
option(DTC_WHEEL_CUDA_RUNTIME "Take the CUDA runtime from the torch wheel, not a CUDA toolkit" OFF)
if(NOT TARGET torch::cudart)
  find_file(_dtc_torch_config Torch/TorchConfig.cmake PATH_SUFFIXES share/cmake NO_CACHE)
  set(_dtc_cudart "")
  if(_dtc_torch_config)
    get_filename_component(_dtc_wheel "${_dtc_torch_config}/../../../.." ABSOLUTE)
    file(GLOB _dtc_cudart "${_dtc_wheel}/../nvidia/cu*/lib/libcudart.so.*")
  endif()
  find_program(_dtc_nvcc nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin NO_CACHE)
  if(_dtc_cudart AND EXISTS "${_dtc_wheel}/lib/libtorch_cuda.so"
     AND (NOT _dtc_nvcc OR DTC_WHEEL_CUDA_RUNTIME))
    list(GET _dtc_cudart 0 _dtc_cudart)
    get_filename_component(_dtc_cu "${_dtc_cudart}/../.." ABSOLUTE)
    add_library(torch::cudart SHARED IMPORTED)
    set_target_properties(torch::cudart PROPERTIES IMPORTED_LOCATION "${_dtc_cudart}"
      INTERFACE_INCLUDE_DIRECTORIES "${_dtc_cu}/include")
    set(DTC_CUDA_FROM_WHEEL ON)
    message(STATUS "dtc: no CUDA toolkit; the CUDA runtime and headers come from the wheel "
                   "(${_dtc_cu})")
  endif()
endif()
find_package(Torch REQUIRED)
get_filename_component(DTC_TORCH_LIBDIR "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(DTC_TORCH_ROOT "${DTC_TORCH_LIBDIR}" DIRECTORY)
set(DTC_TORCH_VERSION "${Torch_VERSION}")
if(DTC_TORCH_VERSION VERSION_LESS 2.0)
  set(DTC_FLAVOR light)
else()
  set(DTC_FLAVOR primary)
endif()

add_library(dtc_torch INTERFACE)
target_link_libraries(dtc_torch INTERFACE ${TORCH_LIBRARIES})
# The c10d headers hide their gloo classes behind this define. Gloo's own headers come from
# Debian's libgloo-dev on both paths (the wheel does not ship them; the classes we use, Device
# and the Options struct, have kept their layout).
target_compile_definitions(dtc_torch INTERFACE USE_C10D_GLOO)
if(DTC_BUNDLE_INCLUDE)
  target_include_directories(dtc_torch SYSTEM INTERFACE "${DTC_BUNDLE_INCLUDE}")  # gloo's headers
endif()
if(TORCH_CXX_FLAGS)
  separate_arguments(_dtc_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(dtc_torch INTERFACE ${_dtc_torch_flags})
endif()

set(DTC_HAVE_NCCL OFF)
if(DTC_FLAVOR STREQUAL "primary")
  # The wheel's CUDA, cuDNN and NCCL libraries live beside torch in site-packages/nvidia/*/lib.
  # libtorch_cuda finds them at run time through its own RUNPATH; the linker must be told too,
  # or it picks the toolkit's older libnccl and fails on missing symbols.
  file(GLOB _dtc_nvidia_libdirs LIST_DIRECTORIES true "${DTC_TORCH_ROOT}/../nvidia/*/lib")
  if(_dtc_nvidia_libdirs)
    string(REPLACE ";" ":" _dtc_rpath_link "${_dtc_nvidia_libdirs}")
    target_link_options(dtc_torch INTERFACE "LINKER:-rpath-link,${_dtc_rpath_link}")
  endif()
  if(TARGET torch_cuda OR EXISTS "${DTC_TORCH_LIBDIR}/libtorch_cuda.so")
    find_path(DTC_NCCL_INCLUDE nccl.h
      HINTS "${DTC_TORCH_ROOT}/../nvidia/nccl/include" "$ENV{CUDA_HOME}/include" /usr/local/cuda/include
      NO_DEFAULT_PATH)
    if(DTC_NCCL_INCLUDE)
      set(DTC_HAVE_NCCL ON)
      target_include_directories(dtc_torch SYSTEM INTERFACE "${DTC_NCCL_INCLUDE}")
      target_compile_definitions(dtc_torch INTERFACE USE_C10D_NCCL DTC_HAVE_NCCL)
    endif()
  endif()
endif()

# fmt: the wheel ships fmt's headers in its include directory, which comes before /usr/include.
# Use exactly those, header-only, so that every file of a build sees one fmt. On the light path,
# Debian's libfmt.
add_library(dtc_fmt INTERFACE)
if(EXISTS "${DTC_TORCH_ROOT}/include/fmt/format.h")
  target_include_directories(dtc_fmt SYSTEM INTERFACE "${DTC_TORCH_ROOT}/include")
  target_compile_definitions(dtc_fmt INTERFACE FMT_HEADER_ONLY=1)
elseif(DTC_BUNDLE_INCLUDE)
  target_include_directories(dtc_fmt SYSTEM INTERFACE "${DTC_BUNDLE_INCLUDE}")
  target_compile_definitions(dtc_fmt INTERFACE FMT_HEADER_ONLY=1)
else()
  find_package(fmt REQUIRED)
  target_link_libraries(dtc_fmt INTERFACE fmt::fmt)
endif()

# The torchrun that goes with this LibTorch, for end-to-end tests and the hints programs print:
# the one beside the wheel's Python on the primary path; Debian's on the light path, whose 1.13
# crashes under Python 3.11 unless output redirection is explicit (--redirects 2 --tee 2), and
# looks at its workers every 5 s (2.x: every 0.1 s), so that each run waited up to 5 s after its
# ranks had ended: --monitor_interval 0.1, as 2.x (tests/support/e2e_common.py: the same flags).
if(DTC_FLAVOR STREQUAL "primary")
  find_program(DTC_TORCHRUN torchrun HINTS "${DTC_TORCH_ROOT}/../../../../bin" NO_DEFAULT_PATH)
  set(DTC_TORCHRUN_FLAGS "")
else()
  find_program(DTC_TORCHRUN torchrun PATHS /usr/bin NO_DEFAULT_PATH)
  set(DTC_TORCHRUN_FLAGS --redirects 2 --tee 2 --monitor_interval 0.1)
endif()

# Tests that start torchrun --standalone share this lock on the light path only: 1.13's
# --standalone always takes port 29400, so two at once would join each other's job. 2.x's picks a
# free port, and its tests run in parallel.
if(DTC_FLAVOR STREQUAL "primary")
  set(DTC_TORCHRUN_LOCK "")
else()
  set(DTC_TORCHRUN_LOCK torchrun_standalone)
endif()

message(STATUS "dtc: ${DTC_FLAVOR} path, LibTorch ${DTC_TORCH_VERSION} at ${DTC_TORCH_ROOT}, "
               "NCCL ${DTC_HAVE_NCCL}")

# One precompiled header of LibTorch, built once and reused by every target that includes it:
# every LibTorch header that dtc/compat.h includes, under the same conditions, so that no file
# parses one of them again (ProcessGroupNCCL.hpp alone took 1.7 s of each file's 7 s, with Clang).
set(_dtc_pch_headers
  <torch/torch.h>
  <torch/version.h>
  <torch/csrc/autograd/function_hook.h>
  <torch/csrc/autograd/variable.h>
  <torch/csrc/distributed/c10d/HashStore.hpp>
  <torch/csrc/distributed/c10d/PrefixStore.hpp>
  <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
  <torch/csrc/distributed/c10d/TCPStore.hpp>)
if(DTC_HAVE_NCCL)
  list(APPEND _dtc_pch_headers <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>)
endif()
if(DTC_TORCH_VERSION VERSION_GREATER_EQUAL 2.8)
  list(APPEND _dtc_pch_headers <torch/csrc/distributed/c10d/FlightRecorder.hpp>)
endif()
# The libraries of the drivers and tests (the command line, JSON, fmt) go in the -O0 header only
# (below), which the drivers and tests use: 2.7 s less for each driver. In the -O1 one they cost every file 0.7 s (Clang; GCC, which loads the whole header
# into each file, 2.5 s) even when it never includes them, as most of the common library and
# the solutions do not.
set(_dtc_pch_glue_headers <fmt/format.h> <fmt/ostream.h> <CLI/CLI.hpp> <nlohmann/json.hpp>)
add_library(dtc_pch OBJECT "${CMAKE_CURRENT_LIST_DIR}/pch.cpp")
target_link_libraries(dtc_pch PUBLIC dtc_torch dtc_fmt)
target_precompile_headers(dtc_pch PUBLIC ${_dtc_pch_headers})

# A second one, at -O0, for the code that is glue around LibTorch's kernels, which keep the
# library's own optimisation: the learner's exercise files (the file a learner edits compiles in
# half the time: lesson 08's, with Clang, 5.5 s instead of 10.4 s), the programs' drivers and
# the tests (GLUE): on the 2-core machine, a whole build's compile time falls from about 970 to
# 580 CPU seconds. At -O1 stay the reference solutions and the benchmarks, whose code is what the
# benchmarks time, and the common library, whose model runs in every program and test (at -O0
# the tests take an eighth longer, more than its compile time saves).
add_library(dtc_pch_exercise OBJECT "${CMAKE_CURRENT_LIST_DIR}/pch.cpp")
target_link_libraries(dtc_pch_exercise PUBLIC dtc_torch dtc_fmt CLI11::CLI11 nlohmann_json::nlohmann_json)
target_compile_options(dtc_pch_exercise PRIVATE -O0)
target_precompile_headers(dtc_pch_exercise PUBLIC ${_dtc_pch_headers} ${_dtc_pch_glue_headers})

# Reuses the LibTorch precompiled header in TARGET (it must not add compile definitions).
# EXERCISE or GLUE: a learner's exercise library, or given code around LibTorch's calls
# (drivers, tests, the common library), compiled at -O0 with the -O0 header.
function(dtc_use_torch_pch target)
  cmake_parse_arguments(P "EXERCISE;GLUE" "" "" ${ARGN})
  if(P_GLUE)
    set(P_EXERCISE ON)
  endif()
  if(P_EXERCISE)
    target_compile_options(${target} PRIVATE -O0)
  endif()
  if(DTC_USE_PCH)
    if(P_EXERCISE)
      target_precompile_headers(${target} REUSE_FROM dtc_pch_exercise)
    else()
      target_precompile_headers(${target} REUSE_FROM dtc_pch)
    endif()
  endif()
endfunction()
