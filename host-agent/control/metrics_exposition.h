// tmemd's counters as Prometheus families: what GET /metrics serves.
//
// Conventions (https://prometheus.io/docs/practices/naming/): a tmem_
// prefix; counters end in _total; units are base units in the name
// (_bytes, _seconds, _ratio for 0..1 fractions); counters that split one
// quantity (puts by how they were stored, gets by result, refusals and
// drops by reason) are one family with a label, so sum() over the family is
// the whole. Per-VM series carry a `vm` label and nothing else shares their
// family: host-wide figures have their own names (tmem_host_*_total: every
// VM since tmemd started, removed VMs included, so not just the sum of the
// live VMs' series); host-wide gauges that would only be that sum are not
// exported. The gRPC API keeps its own (older) names: this mapping is the
// exposition's only.
//
// The mapping is a switch per counter enum without a default, so a counter
// added to backend/stats.h, backend/valve.h or
// host-agent/channel/channel_metrics.h does not build (-Wswitch -Werror)
// until it is given a family and HELP text here.
#ifndef TMEMD_HOST_AGENT_CONTROL_METRICS_EXPOSITION_H_
#define TMEMD_HOST_AGENT_CONTROL_METRICS_EXPOSITION_H_

#include <string>
#include <string_view>

#include "backend/stats.h"
#include "backend/valve.h"
#include "host-agent/agent.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/control/prometheus_text.h"

namespace tmem {

// Where one counter goes: its per-VM family, the label that tells it from
// the family's other counters (label empty: none), and its host-wide family
// (name empty: not exported host-wide).
struct CounterSeries {
  MetricFamily vm_family;
  std::string_view label;
  std::string_view label_value;
  MetricFamily host_family;
};

CounterSeries StoreCounterSeries(Counter c);
CounterSeries ValveCounterSeries(ValveCounter c);
CounterSeries ChannelCounterSeries(ChannelCounter c);

// The whole exposition for `agent`, into `out` (callers may add their own
// families, e.g. the HTTP server's counters, before rendering).
void AppendAgentMetrics(const Agent& agent, PrometheusText& out);
std::string RenderPrometheus(const Agent& agent);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_METRICS_EXPOSITION_H_
