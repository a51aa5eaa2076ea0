// \brief Kernel-path tables: how each op chooses among its kernels, in one
// readable place, with a debug hook that lets tests force a path and ask
// which one ran.
//
// An op's dispatch is a `PathTable`: an ordered list of `Path`s, each with a
// short name, the condition under which it is taken (one line), the reason
// it exists (one line), a predicate and a launcher.  A call takes the first
// path whose predicate holds; the last path of every table must hold always.
//
//   static const PathTable<FlowEulerCall> kPaths("flow_euler", "cuda", {{
//       {"split", "float32, D=64, H=256, sm_90, B <= SMs/2", "...", split_applies, launch_split},
//       ...
//       {"general", "anything else", "correctness first", always, launch_general},
//   }});
//   kPaths.run(call);
//
// A predicate is the COMPLETE condition under which its launcher is correct,
// not "correct given that the paths above did not apply": a forced path runs
// whenever its own predicate holds.
//
// Debug hook (fused_ops/_paths.py; the _C module's _paths/_force_path/
// _last_path functions, csrc/fused_ops.cpp): every table registers itself by
// (op, device) when the library loads.  A forced path is taken instead of the
// first applicable one; when its predicate does not hold the call fails with
// an error that lists every path and whether it applies (nothing unsafe is
// ever launched).  `last` is the path the latest call took, on any thread:
// for tests, which run one op at a time.  Both are relaxed atomics, one load
// and one store per call.
#pragma once

#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"

namespace fused_ops {
namespace dispatch {

// What the registry knows of a table, independent of its call type.
struct TableInfo {
  const char* op;
  const char* device;
  std::vector<const char*> names, when, why;
  std::atomic<int> forced{-1};  // index into names, -1: none
  std::atomic<int> last{-1};    // index of the path the latest call took
};

// Every table of the library, registered at load time; never shrinks.
inline std::vector<TableInfo*>& registry() {
  static std::vector<TableInfo*> tables;
  return tables;
}

inline TableInfo* find_table(const char* op, const char* device) {
  for (TableInfo* t : registry()) {
    if (std::strcmp(t->op, op) == 0 && std::strcmp(t->device, device) == 0) return t;
  }
  return nullptr;
}

// Whether `path` of (op, device)'s table is forced (fused_ops._paths.force):
// for a path whose natural condition holds a measured preference on top of
// what it can run (a batch-size range, a crossover with another path), so
// that forcing it reaches every size it computes correctly.
inline bool is_forced(const char* op, const char* device, const char* path) {
  const TableInfo* t = find_table(op, device);
  const int f = t ? t->forced.load(std::memory_order_relaxed) : -1;
  return f >= 0 && std::strcmp(t->names[size_t(f)], path) == 0;
}

template <typename Call>
struct Path {
  const char* name;  // what tests and FUSED_OPS_FORCE_PATH call it
  const char* when;  // the condition, one line
  const char* why;   // why this path exists, one line
  bool (*applies)(const Call&);
  void (*launch)(const Call&);
};

template <typename Call>
inline bool always(const Call&) {
  return true;
}

template <typename Call, size_t N>
class PathTable {
 public:
  PathTable(const char* op, const char* device, const std::array<Path<Call>, N>& paths)
      : paths_(paths) {
    for (const Path<Call>& p : paths_) {
      // A table declared with more entries than it lists: a bug, caught at load.
      FUSED_OPS_CHECK(p.name && p.when && p.why && p.applies && p.launch, op, " (", device,
                      "): a kernel path table entry is incomplete");
    }
    info_.op = op;
    info_.device = device;
    for (const Path<Call>& p : paths_) {
      info_.names.push_back(p.name);
      info_.when.push_back(p.when);
      info_.why.push_back(p.why);
    }
    registry().push_back(&info_);
  }
  PathTable(const PathTable&) = delete;
  PathTable& operator=(const PathTable&) = delete;

  // The path this call takes: the forced one, else the first that applies.
  const Path<Call>& select(const Call& c) const {
    const int forced = info_.forced.load(std::memory_order_relaxed);
    int chosen = forced;
    if (forced >= 0) {
      FUSED_OPS_CHECK(paths_[forced].applies(c), refusal(c, forced));
    } else {
      chosen = int(N) - 1;
      for (int i = 0; i + 1 < int(N); ++i) {
        if (paths_[i].applies(c)) {
          chosen = i;
          break;
        }
      }
    }
    info_.last.store(chosen, std::memory_order_relaxed);
    return paths_[chosen];
  }

  void run(const Call& c) const { select(c).launch(c); }

  // The forced path's name, nullptr when none is forced (an op that routes
  // some calls around its table, e.g. to a float32 fallback, honours a force).
  const char* forced_name() const {
    const int forced = info_.forced.load(std::memory_order_relaxed);
    return forced >= 0 ? paths_[forced].name : nullptr;
  }

 private:
  // xformers-style: say why the forced path cannot run, and what would.
  std::string refusal(const Call& c, int forced) const {
    std::string s = std::string(info_.op) + " (" + info_.device + "): the forced kernel path '" +
                    paths_[forced].name + "' does not apply to this call (needs: " +
                    paths_[forced].when + "). Paths:";
    for (const Path<Call>& p : paths_) {
      s += std::string("\n  ") + p.name + (p.applies(c) ? "  [applies]  " : "  [does not apply]  ") +
           p.when;
    }
    return s;
  }

  std::array<Path<Call>, N> paths_;
  mutable TableInfo info_;
};

}  // namespace dispatch
}  // namespace fused_ops
