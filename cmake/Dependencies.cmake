# All third-party dependencies, found once for the whole tree.
# Package names and targets: see docs/building.md.
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(cxxopts 3 CONFIG REQUIRED)         # cxxopts::cxxopts
find_package(spdlog 1.10 CONFIG REQUIRED)        # spdlog::spdlog (brings fmt)
find_package(nlohmann_json 3 CONFIG REQUIRED)    # nlohmann_json::nlohmann_json
find_package(dnnl CONFIG REQUIRED)               # DNNL::dnnl (needs ocl-icd-opencl-dev)
find_package(ZLIB REQUIRED)                      # ZLIB::ZLIB
find_package(PkgConfig REQUIRED)
pkg_check_modules(CAIRO REQUIRED IMPORTED_TARGET cairo)  # PkgConfig::CAIRO (training curves)
find_package(PNG REQUIRED)                       # PNG::PNG (image folders)
pkg_check_modules(TURBOJPEG REQUIRED IMPORTED_TARGET libturbojpeg)  # PkgConfig::TURBOJPEG (tests write JPEGs)
# libjpeg-turbo's libjpeg API: every JPEG decoded, a crop's rows and columns alone
# (data/image_decode.cpp).
pkg_check_modules(LIBJPEG REQUIRED IMPORTED_TARGET libjpeg)  # PkgConfig::LIBJPEG
find_package(Protobuf REQUIRED)                  # protobuf::libprotobuf, which ONNX's targets name
find_package(ONNX CONFIG REQUIRED)               # onnx, onnx_proto (--model FILE.onnx)
find_package(Gloo CONFIG QUIET)                  # plain target `gloo` (collectives, later)
find_package(MPI QUIET COMPONENTS CXX)           # MPI::MPI_CXX (collectives, later)
if(MTRAIN_BUILD_TESTS)
  find_package(Catch2 2 CONFIG REQUIRED)         # Catch2::Catch2 (v2, single header)
endif()

# CUDA: compiled whenever toolkit + cuDNN + NCCL are present. Only the runtime API
# (CUDA::cudart) is linked, never the driver library: the binaries must start on
# machines without a driver (cudart reports "insufficient driver" there and we treat
# that as zero devices).
set(MTRAIN_HAVE_CUDA OFF)
if(MTRAIN_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  find_package(CUDAToolkit QUIET)
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(CUDNN_LIBRARY AND CUDNN_INCLUDE_DIR AND NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES 80 90)   # A100, H100/H200
      endif()
      enable_language(CUDA)
      set(CMAKE_CUDA_STANDARD 17)   # CMake 3.25 has no CUDA20 flags for nvcc
      set(CMAKE_CUDA_STANDARD_REQUIRED ON)
      add_library(mtrain::cudnn UNKNOWN IMPORTED)
      set_target_properties(mtrain::cudnn PROPERTIES
        IMPORTED_LOCATION ${CUDNN_LIBRARY} INTERFACE_INCLUDE_DIRECTORIES ${CUDNN_INCLUDE_DIR})
      add_library(mtrain::nccl UNKNOWN IMPORTED)
      set_target_properties(mtrain::nccl PROPERTIES
        IMPORTED_LOCATION ${NCCL_LIBRARY} INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
      set(MTRAIN_HAVE_CUDA ON)
    else()
      message(STATUS "mtrain: CUDA toolkit found but cuDNN or NCCL missing; building CPU only")
    endif()
  else()
    message(STATUS "mtrain: no CUDA toolkit; building CPU only")
  endif()
endif()
message(STATUS "mtrain: CUDA path ${MTRAIN_HAVE_CUDA}")
