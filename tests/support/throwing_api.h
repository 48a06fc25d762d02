// The classes of tests/support/throwing_lib.cpp (a stand-in libtorch_cpu.so), shared with the program that
// calls them: the demangled names are the ones the torch tracer probes.
#pragma once
#include <chrono>

namespace gloo { namespace transport { namespace tcp {
class UnboundBuffer {
 public:
  bool waitRecv(int* rank, std::chrono::milliseconds timeout);
  bool waitSend(int* rank, std::chrono::milliseconds timeout);
};
}}}  // namespace gloo::transport::tcp

namespace c10d {
class Work {
 public:
  virtual ~Work() = default;
  virtual bool wait(std::chrono::milliseconds timeout);
};
}  // namespace c10d
