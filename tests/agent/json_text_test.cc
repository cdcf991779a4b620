// JsonEscaped, the one hand-written JSON string escaper (tmemd's JSON log
// lines, tmem-guestsim's report): whatever the bytes, a JSON parser reads
// back exactly the text that went in.
#include "host-agent/common/json_text.h"

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tmem {
namespace {

std::string ParsedBack(const std::string& s) {
  std::string quoted = "\"";
  AppendJsonEscaped(quoted, s);
  quoted.push_back('"');
  return nlohmann::json::parse(quoted).get<std::string>();
}

TEST(JsonTextTest, QuotesBackslashesAndControlCharactersAreEscaped) {
  EXPECT_EQ(JsonEscaped("say \"hi\""), "say \\\"hi\\\"");
  EXPECT_EQ(JsonEscaped("a\\b"), "a\\\\b");
  EXPECT_EQ(JsonEscaped("one\ntwo"), "one\\ntwo");
  EXPECT_EQ(JsonEscaped(std::string("\x01\t\x1f", 3)), "\\u0001\\u0009\\u001f");
  EXPECT_EQ(JsonEscaped("plain/text é"), "plain/text é");
}

TEST(JsonTextTest, EveryAsciiByteAndUtf8ReadsBackExactly) {
  std::string all;
  for (int c = 1; c < 128; ++c) all.push_back(static_cast<char>(c));
  EXPECT_EQ(ParsedBack(all), all);
  EXPECT_EQ(ParsedBack("vm \"web1\" \xe2\x9c\x93 ok"),
            "vm \"web1\" \xe2\x9c\x93 ok");
  EXPECT_EQ(ParsedBack(""), "");
}

TEST(JsonTextTest, AppendKeepsWhatIsThere) {
  std::string out = R"({"k":")";
  AppendJsonEscaped(out, "a\"b");
  out += "\"}";
  EXPECT_EQ(nlohmann::json::parse(out)["k"], "a\"b");
}

}  // namespace
}  // namespace tmem
