// Finds and loads libnccl at run time. Candidates come from Python (NCCL_LIBRARY, the installed
// nvidia-nccl wheel, then the system loader path); the first that loads and exports every symbol
// in nccl::Api wins. Loading happens once per process.
#pragma once
#include <string>
#include <vector>

#include "nccl/nccl_api.h"

namespace asyncpp::nccl {

struct LoadResult {
  bool ok = false;
  std::string path;     // the candidate that loaded
  int version = 0;      // ncclGetVersion, e.g. 22703 for 2.27.3
  std::string error;    // why each candidate failed, when !ok
};

// Tries the candidates in order; returns the first success (and remembers it for api()).
LoadResult load(const std::vector<std::string>& candidates);
// The loaded function table; throws asyncpp::Error if load() has not succeeded.
const Api& api();

}  // namespace asyncpp::nccl
