// The subset of the NCCL C API the transport uses, declared from NCCL's documented interface so
// that building needs no NCCL headers. The library itself is dlopen'ed at run time (nccl_loader).
#pragma once
#include <cstddef>

namespace asyncpp::nccl {

using Result = int;  // ncclResult_t; 0 = ncclSuccess
using Comm = struct ncclComm*;  // ncclComm_t, opaque
using Stream = void*;           // cudaStream_t
struct UniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
enum DataType : int {  // ncclDataType_t
  kInt8 = 0, kUint8 = 1, kInt32 = 2, kUint32 = 3, kInt64 = 4, kUint64 = 5,
  kFloat16 = 6, kFloat32 = 7, kFloat64 = 8, kBfloat16 = 9,
};

// Function table filled by dlsym. Names match the NCCL symbols.
struct Api {
  Result (*ncclGetVersion)(int*) = nullptr;
  const char* (*ncclGetErrorString)(Result) = nullptr;
  Result (*ncclGetUniqueId)(UniqueId*) = nullptr;
  Result (*ncclCommInitRank)(Comm*, int, UniqueId, int) = nullptr;
  Result (*ncclCommDestroy)(Comm) = nullptr;
  Result (*ncclCommAbort)(Comm) = nullptr;
  Result (*ncclCommGetAsyncError)(Comm, Result*) = nullptr;
  Result (*ncclGroupStart)() = nullptr;
  Result (*ncclGroupEnd)() = nullptr;
  Result (*ncclSend)(const void*, size_t, DataType, int, Comm, Stream) = nullptr;
  Result (*ncclRecv)(void*, size_t, DataType, int, Comm, Stream) = nullptr;
};

}  // namespace asyncpp::nccl
