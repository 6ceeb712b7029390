// Chooses the ISA of the CPU optimizer loops once per process (cpu_isa.h).
#include "kernels/cpu_isa.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "kernels/optim_cpu_loops.h"

namespace asyncpp::kernels {
namespace {

constexpr const char* kEnv = "ASYNCPP_CPU_ISA";

// How ASYNCPP_CPU_ISA spells an ISA in the list of values that would work.
const char* env_spelling(CpuIsa isa) { return isa == CpuIsa::avx512f ? "avx512" : cpu_isa_name(isa); }

std::optional<CpuIsa> parse(const std::string& lowered) {
  if (lowered == "baseline") return CpuIsa::baseline;
  if (lowered == "avx2") return CpuIsa::avx2;
  if (lowered == "avx512" || lowered == "avx512f") return CpuIsa::avx512f;
  return std::nullopt;
}

std::vector<CpuIsa> built_isas() {
#if ASYNCPP_HAS_ISA_VARIANTS
  return {CpuIsa::baseline, CpuIsa::avx2, CpuIsa::avx512f};
#else
  return {CpuIsa::baseline};
#endif
}

// Why a build has the baseline only.
const char* why_baseline_only() {
#ifdef ASYNCPP_NO_ISA_CLONES
  return "it was built with -DASYNCPP_NO_ISA_CLONES";
#else
  return "variants are built only for x86-64 with GCC or Clang";
#endif
}

// __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
bool cpu_supports(CpuIsa isa) {
  if (isa == CpuIsa::baseline) return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == CpuIsa::avx2) return __builtin_cpu_supports("avx2");
  if (isa == CpuIsa::avx512f) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

bool contains(const std::vector<CpuIsa>& isas, CpuIsa isa) {
  return std::find(isas.begin(), isas.end(), isa) != isas.end();
}

std::string trimmed(const char* raw) {
  std::string s = raw ? raw : "";
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  s.erase(s.begin(), std::find_if_not(s.begin(), s.end(), space));
  s.erase(std::find_if_not(s.rbegin(), s.rend(), space).base(), s.end());
  return s;
}

CpuIsaSelection select() {
  CpuIsaSelection s;
  s.built = built_isas();
  for (CpuIsa isa : s.built)
    if (cpu_supports(isa)) s.runnable.push_back(isa);

  const std::string value = trimmed(std::getenv(kEnv));
  std::string lowered = value;
  for (char& c : lowered) c = char(std::tolower(static_cast<unsigned char>(c)));

  if (lowered.empty() || lowered == "auto") {
    s.ok = true;
    s.isa = s.runnable.back();  // built_isas() lists them from worst to best
    s.reason = "auto: best of the built ISAs this CPU supports";
    if (s.built.size() == 1) s.reason = detail::concat(s.reason, " (baseline only: ", why_baseline_only(), ")");
    for (CpuIsa isa : s.built)
      if (!contains(s.runnable, isa)) s.reason = detail::concat(s.reason, " (", cpu_isa_name(isa), " not supported)");
    return s;
  }

  const std::optional<CpuIsa> wanted = parse(lowered);
  std::string why;
  if (!wanted) {
    why = "not a known ISA";
  } else if (!contains(s.built, *wanted)) {
    why = detail::concat("this build has no ", cpu_isa_name(*wanted), " variant (", why_baseline_only(), ")");
  } else if (!contains(s.runnable, *wanted)) {
    why = detail::concat("this CPU does not support ", cpu_isa_name(*wanted));
  } else {
    s.ok = true;
    s.isa = *wanted;
    s.reason = detail::concat("forced by ", kEnv, "=", value);
    return s;
  }
  std::string usable = "auto";
  for (CpuIsa isa : s.runnable) usable = detail::concat(usable, ", ", env_spelling(isa));
  s.error = detail::concat(kEnv, "=", value, ": ", why, "; use one of ", usable, " (or unset it)");
  return s;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512f: return "avx512f";
    default: return "baseline";
  }
}

const CpuIsaSelection& cpu_isa_selection() {
  static const CpuIsaSelection selection = select();
  return selection;
}

CpuIsa cpu_kernel_isa() {
  const CpuIsaSelection& s = cpu_isa_selection();
  if (!s.ok) throw ArgumentError(s.error);
  return s.isa;
}

}  // namespace asyncpp::kernels
