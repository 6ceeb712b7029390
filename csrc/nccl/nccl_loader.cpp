#include "nccl/nccl_loader.h"

#include <dlfcn.h>

#include <mutex>

#include "core/error.h"

namespace asyncpp::nccl {
namespace {

std::mutex g_mutex;
Api g_api;
LoadResult g_loaded;

template <typename Fn>
bool bind(void* handle, const char* name, Fn& slot, std::string& missing) {
  slot = reinterpret_cast<Fn>(dlsym(handle, name));
  if (!slot) missing += std::string(missing.empty() ? "" : ", ") + name;
  return slot != nullptr;
}

}  // namespace

LoadResult load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loaded.ok) return g_loaded;
  LoadResult result;
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* why = dlerror();
      result.error += path + ": " + (why ? why : "cannot be loaded") + "; ";
      continue;
    }
    Api api;
    std::string missing;
    bind(handle, "ncclGetVersion", api.ncclGetVersion, missing);
    bind(handle, "ncclGetErrorString", api.ncclGetErrorString, missing);
    bind(handle, "ncclGetUniqueId", api.ncclGetUniqueId, missing);
    bind(handle, "ncclCommInitRank", api.ncclCommInitRank, missing);
    bind(handle, "ncclCommDestroy", api.ncclCommDestroy, missing);
    bind(handle, "ncclCommAbort", api.ncclCommAbort, missing);
    bind(handle, "ncclCommGetAsyncError", api.ncclCommGetAsyncError, missing);
    bind(handle, "ncclGroupStart", api.ncclGroupStart, missing);
    bind(handle, "ncclGroupEnd", api.ncclGroupEnd, missing);
    bind(handle, "ncclSend", api.ncclSend, missing);
    bind(handle, "ncclRecv", api.ncclRecv, missing);
    if (!missing.empty()) {
      result.error += path + ": missing symbols " + missing + "; ";
      dlclose(handle);
      continue;
    }
    int version = 0;
    api.ncclGetVersion(&version);
    g_api = api;
    g_loaded = LoadResult{true, path, version, ""};
    return g_loaded;
  }
  if (candidates.empty()) result.error = "no candidate paths given";
  return result;
}

const Api& api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  ASYNCPP_CHECK(g_loaded.ok, "NCCL is not loaded: install the nvidia-nccl-cu12/cu13 wheel or set "
                "NCCL_LIBRARY to libnccl.so.2 (asyncpp_ext.build_info() shows what was tried)");
  return g_api;
}

}  // namespace asyncpp::nccl
