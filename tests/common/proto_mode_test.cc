// The valve mode's three spellings (host-agent/common/proto_mode.h): every
// mode round-trips, and whatever is not a mode is refused with its source.
#include "host-agent/common/proto_mode.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace tmem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct Spelling {
  ValveMode valve;
  v1::Mode proto;
  std::string text;
};

const Spelling kEveryMode[] = {
    {ValveMode::kDefault, v1::MODE_DEFAULT, "default"},
    {ValveMode::kOff, v1::MODE_OFF, "off"},
    {ValveMode::kAlways, v1::MODE_ALWAYS, "always"},
    {ValveMode::kAdaptive, v1::MODE_ADAPTIVE, "adaptive"},
};

TEST(ProtoModeTest, EveryModeRoundTripsThroughAllThreeSpellings) {
  for (const Spelling& m : kEveryMode) {
    SCOPED_TRACE(m.text);
    EXPECT_EQ(ProtoMode(m.valve), m.proto);
    EXPECT_EQ(ProtoModeText(m.proto), m.text);
    EXPECT_EQ(ValveModeName(m.valve), m.text);
    absl::StatusOr<ValveMode> from_proto =
        ValveModeFromProto(m.proto, DefaultMode::kAllowed, "test");
    ASSERT_TRUE(from_proto.ok()) << from_proto.status();
    EXPECT_EQ(*from_proto, m.valve);
    absl::StatusOr<v1::Mode> from_text =
        ProtoModeFromText(m.text, DefaultMode::kAllowed, "test");
    ASSERT_TRUE(from_text.ok()) << from_text.status();
    EXPECT_EQ(*from_text, m.proto);
  }
}

TEST(ProtoModeTest, EveryModeButDefaultIsAHostDefault) {
  for (const Spelling& m : kEveryMode) {
    SCOPED_TRACE(m.text);
    absl::StatusOr<ValveMode> from_proto =
        ValveModeFromProto(m.proto, DefaultMode::kRefused, "host");
    absl::StatusOr<v1::Mode> from_text =
        ProtoModeFromText(m.text, DefaultMode::kRefused, "host");
    if (m.valve == ValveMode::kDefault) {
      // The host default cannot itself defer to a default.
      EXPECT_EQ(from_proto.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(from_proto.status().message(),
                  AllOf(HasSubstr("host: "), HasSubstr("(default)"),
                        HasSubstr("use off, always or adaptive")));
      EXPECT_EQ(from_text.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(from_text.status().message(),
                  AllOf(HasSubstr("host: 'default' is not a mode"),
                        HasSubstr("use off, always or adaptive")));
    } else {
      ASSERT_TRUE(from_proto.ok()) << from_proto.status();
      EXPECT_EQ(*from_proto, m.valve);
      ASSERT_TRUE(from_text.ok()) << from_text.status();
      EXPECT_EQ(*from_text, m.proto);
    }
  }
}

TEST(ProtoModeTest, UnknownProtoNumberIsRefusedWithItsSource) {
  // A newer or hostile client can send any enum number on the wire.
  const auto unknown = static_cast<v1::Mode>(99);
  absl::StatusOr<ValveMode> m = ValveModeFromProto(
      unknown, DefaultMode::kAllowed, "SetVmPolicy VM 'web1'");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(),
              AllOf(HasSubstr("SetVmPolicy VM 'web1': mode value 99 is not a "
                              "mode"),
                    HasSubstr("use default, off, always or adaptive")));
  EXPECT_EQ(ProtoModeText(unknown), "-");
}

TEST(ProtoModeTest, UnspecifiedIsNotAMode) {
  // MODE_UNSPECIFIED means "leave unchanged"; callers test for it first, and
  // a conversion that gets it anyway refuses it rather than picking a mode.
  absl::StatusOr<ValveMode> m =
      ValveModeFromProto(v1::MODE_UNSPECIFIED, DefaultMode::kAllowed, "rpc");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("rpc: mode value 0"));
  EXPECT_EQ(ProtoModeText(v1::MODE_UNSPECIFIED), "-");
}

TEST(ProtoModeTest, MisspelledTextIsRefusedWithItsSource) {
  for (const char* text : {"fast", "Off", " off", "", "adaptive2"}) {
    SCOPED_TRACE(text);
    absl::StatusOr<v1::Mode> m =
        ProtoModeFromText(text, DefaultMode::kAllowed, "policy.toml: vm[0]");
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(),
                HasSubstr(std::string("policy.toml: vm[0]: '") + text +
                          "' is not a mode"));
  }
}

}  // namespace
}  // namespace tmem
