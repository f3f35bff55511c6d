# -DDTC_BUNDLE=<dir>: build with what scripts/gpu-bundle.sh gathered instead of Debian's -dev
# packages, for a machine that has a compiler, CMake, ninja, CUDA and a Python with PyTorch, and no
# package registry (a GPU node). The bundle holds:
#   include/     CLI11, nlohmann_json and fmt (header-only), gloo's headers (c10d's
#                ProcessGroupGloo.hpp includes them; no LibTorch ships them)
#   googletest/  GoogleTest's sources, built here as part of this build
#   MANIFEST     what came from which Debian package, at which version
# Defines the targets the course links (CLI11::CLI11, nlohmann_json::nlohmann_json, GTest::gtest,
# GTest::gtest_main) so that the top CMakeLists skips its find_package calls; DtcTorch.cmake adds
# include/ for gloo and takes fmt from it when LibTorch ships none.
if(NOT DTC_BUNDLE)
  return()
endif()
get_filename_component(DTC_BUNDLE "${DTC_BUNDLE}" ABSOLUTE)
foreach(_need include/CLI/CLI.hpp include/nlohmann/json.hpp include/gloo/algorithm.h
              googletest/CMakeLists.txt)
  if(NOT EXISTS "${DTC_BUNDLE}/${_need}")
    message(FATAL_ERROR "DTC_BUNDLE=${DTC_BUNDLE} has no ${_need}: it is not a bundle made by "
                        "scripts/gpu-bundle.sh.\nHINT: make one on a machine with the course's "
                        "packages (scripts/gpu-bundle.sh DIR) and pass -DDTC_BUNDLE=DIR")
  endif()
endforeach()
set(DTC_BUNDLE_INCLUDE "${DTC_BUNDLE}/include")

add_library(CLI11::CLI11 INTERFACE IMPORTED GLOBAL)
set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${DTC_BUNDLE_INCLUDE}")
add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED GLOBAL)
set_target_properties(nlohmann_json::nlohmann_json PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${DTC_BUNDLE_INCLUDE}")

# GoogleTest from source, without gmock and without install rules.
set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
add_subdirectory("${DTC_BUNDLE}/googletest" "${PROJECT_BINARY_DIR}/_deps/googletest"
                 EXCLUDE_FROM_ALL)
foreach(_t gtest gtest_main)
  if(NOT TARGET GTest::${_t})
    add_library(GTest::${_t} ALIAS ${_t})
  endif()
endforeach()
message(STATUS "dtc: dependencies from the bundle ${DTC_BUNDLE}")
