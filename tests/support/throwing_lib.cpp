// A stand-in libtorch_cpu.so for tests/test_return_probe_safety.py: functions
// under the demangled names the torch tracer probes (gloo's
// UnboundBuffer::waitRecv/waitSend, c10d::Work::wait), some of which throw, as
// the real ones do on a timeout or a lost peer. Built with g++ by the test.
#include <chrono>
#include <stdexcept>
#include <string>

#include "throwing_api.h"

namespace {
// Not inlined: the exception passes through the probed function's frame, as
// gloo's throws from deeper helpers do.
__attribute__((noinline)) void fail_if(bool fail, const char* what) {
  if (fail) throw std::runtime_error(what);
}
}  // namespace

namespace gloo { namespace transport { namespace tcp {
bool UnboundBuffer::waitRecv(int* rank, std::chrono::milliseconds timeout) {
  fail_if(timeout.count() < 0, "Timed out waiting for a peer (recv)");
  if (rank) *rank = 1;
  return true;
}
bool UnboundBuffer::waitSend(int* rank, std::chrono::milliseconds timeout) {
  fail_if(timeout.count() < 0, "Connection closed by peer (send)");
  if (rank) *rank = 2;
  return true;
}
}}}  // namespace gloo::transport::tcp

namespace c10d {
bool Work::wait(std::chrono::milliseconds timeout) {
  fail_if(timeout.count() < 0, "Work::wait timed out");
  return true;
}
}  // namespace c10d

// The program's access to a Work without exposing the class layout.
extern "C" c10d::Work* fleetscope_test_new_work() { return new c10d::Work(); }
