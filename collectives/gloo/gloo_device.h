// The Gloo TCP device of a rank, listening on the local address that reaches the master. Free
// functions, no shared state.
#pragma once

#include <gloo/transport/device.h>

#include <cstdint>
#include <memory>
#include <string>

#include "store/network_address.h"

namespace mtrain {

// The address this host uses to reach `master_host:master_port` (route_local_address in
// store/network_address.h, naming "gloo" in its errors), unless
// GLOO_SOCKET_IFNAME=IFACE[,...] names the interface: then the first one's address, as in
// PyTorch. Throws CommError naming the master when it cannot be resolved or routed,
// InvalidArgument when GLOO_SOCKET_IFNAME names no interface with an address.
LocalAddress local_address_reaching(const std::string& master_host, uint16_t master_port);

// How the device's event-loop thread is scheduled (Note [Gloo event-loop priority] in
// gloo_device.cpp). From MTRAIN_GLOO_LOOP_SCHED: "nice" (the default: the creator's
// policy at nice kGlooLoopNice, or the creator's own nice value if that is higher),
// "idle" (SCHED_IDLE) or "normal" (as the creator); any other value is an
// InvalidArgument naming the variable.
enum class LoopScheduling { Nice, Idle, Normal };
inline constexpr int kGlooLoopNice = 10;
LoopScheduling loop_scheduling_from_env();

// A TCP device bound to `address` (peers connect to it, so it must be reachable from
// them; the master's route is the one every rank shares). Its event-loop thread is
// scheduled as `loop`; the calling thread's own scheduling is left as it was.
std::shared_ptr<gloo::transport::Device> create_tcp_device(
    const LocalAddress& address, LoopScheduling loop = loop_scheduling_from_env());

}  // namespace mtrain
