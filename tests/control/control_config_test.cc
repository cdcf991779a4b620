// The [control] section of tmemd's config: every key, strictness, and the
// cross-check that TCP needs mutual TLS.
#include <gtest/gtest.h>

#include "host-agent/config.h"

namespace tmem {
namespace {

TEST(ControlConfigTest, EveryKeyIsRead) {
  auto c = ParseConfig(R"(
[control]
socket = "/run/x/control.sock"
readonly_socket = "/run/x/ro.sock"
tcp_address = "0.0.0.0:7117"
tls_cert = "/etc/tmemd/server.pem"
tls_key = "/etc/tmemd/server.key"
tls_ca = "/etc/tmemd/ca.pem"
admin = ["ops-admin", "fleet.example.com"]
state_file = "/var/lib/tmemd/state.json"
metrics_port = 9417
metrics_address = "0.0.0.0"
max_admin_connections = 100
max_readonly_connections = 4
max_tcp_connections = 20
reserved_vm_channels = 500
)",
                       "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  const ControlConfig& k = c->control;
  EXPECT_EQ(*k.socket, "/run/x/control.sock");
  EXPECT_EQ(k.readonly_socket, "/run/x/ro.sock");
  EXPECT_EQ(k.tcp_address, "0.0.0.0:7117");
  EXPECT_EQ(k.tls_cert, "/etc/tmemd/server.pem");
  EXPECT_EQ(k.tls_key, "/etc/tmemd/server.key");
  EXPECT_EQ(k.tls_ca, "/etc/tmemd/ca.pem");
  ASSERT_EQ(k.admin.size(), 2u);
  EXPECT_EQ(k.admin[1], "fleet.example.com");
  EXPECT_EQ(k.state_file, "/var/lib/tmemd/state.json");
  EXPECT_EQ(k.metrics_port, 9417);
  EXPECT_EQ(k.metrics_address, "0.0.0.0");
  EXPECT_EQ(k.max_admin_connections, 100);
  EXPECT_EQ(k.max_readonly_connections, 4);
  EXPECT_EQ(k.max_tcp_connections, 20);
  EXPECT_EQ(k.reserved_vm_channels, 500);
  EXPECT_TRUE(ValidateConfig(*c).ok());
}

TEST(ControlConfigTest, DefaultsAreLocalOnly) {
  const TmemdConfig c;
  EXPECT_FALSE(c.control.socket.has_value());  // SOCKET_DIR/control.sock
  EXPECT_TRUE(c.control.tcp_address.empty());
  EXPECT_EQ(c.control.metrics_port, -1);
  EXPECT_TRUE(c.control.state_file.empty());
  // The world-accessible socket gets far fewer connections than the admin.
  EXPECT_LE(c.control.max_readonly_connections * 4,
            c.control.max_admin_connections);
}

TEST(ControlConfigTest, MistakesAreErrors) {
  for (auto [text, expect] : {
           std::pair{"[control]\nsocet = \"x\"", "control.socet"},
           std::pair{"[control]\nadmin = \"ops\"", "control.admin"},
           std::pair{"[control]\nadmin = [1]", "control.admin"},
           std::pair{"[control]\nmetrics_port = 70000", "control.metrics_port"},
           std::pair{"[control]\nmax_readonly_connections = 0",
                     "max_readonly_connections must be in [1, 65536]"},
           std::pair{"[control]\nmax_admin_connections = 70000",
                     "control.max_admin_connections"},
           std::pair{"[control]\nreserved_vm_channels = -1",
                     "control.reserved_vm_channels"},
       }) {
    auto c = ParseConfig(text, "t.toml", TmemdConfig{});
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find(expect), std::string::npos)
        << c.status().message();
  }
  auto c = ParseConfig("[control]\ntcp_address = \"0.0.0.0:7117\"\n", "t.toml",
                       TmemdConfig{});
  ASSERT_TRUE(c.ok());
  const absl::Status s = ValidateConfig(*c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("mutual TLS"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace tmem
