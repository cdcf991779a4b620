// tmemd --check-config FILE: the real binary on good and bad files. A good
// file exits 0 without starting anything; a bad one exits 2 with the error
// located (FILE:LINE from the loader, or FILE: for cross-field checks).
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

struct Result {
  int code = -1;
  std::string output;
};

Result CheckConfig(const testing::TempDir& dir, const std::string& file) {
  const std::string log = dir.path() + "/check.log";
  testing::Process p({TMEMD_BIN, "--check-config", file}, log);
  Result r;
  r.code = p.Wait();
  r.output = p.Log();
  return r;
}

std::string Write(const testing::TempDir& dir, const std::string& name,
                  const std::string& text) {
  std::string path = dir.path() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(CheckConfigTest, ExampleAndPackagedConfigsPass) {
  testing::TempDir dir("check-config");
  for (const std::string& file :
       {std::string(TMEM_SOURCE_DIR "/host-agent/tmemd.example.toml"),
        std::string(PACKAGED_CONFIG)}) {
    const Result r = CheckConfig(dir, file);
    EXPECT_EQ(r.code, 0) << file << ": " << r.output;
    EXPECT_NE(r.output.find(file + ": configuration OK"), std::string::npos)
        << r.output;
  }
}

TEST(CheckConfigTest, StartsNothing) {
  testing::TempDir dir("check-config");
  const std::string sockets = dir.path() + "/sockets";
  const std::string file = Write(dir, "ok.toml",
                                 "[channels]\nsocket_dir = \"" + sockets +
                                     "\"\n[[vm]]\nname = \"web1\"\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(testing::PathExists(sockets))
      << "--check-config created " << sockets;
}

TEST(CheckConfigTest, WrongTypeNamesFileAndLine) {
  testing::TempDir dir("check-config");
  const std::string file = Write(
      dir, "bad.toml", "[store]\nshards = 64\n\n[worker]\nbatch = \"64\"\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("worker.batch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(file + ":5"), std::string::npos) << r.output;
}

TEST(CheckConfigTest, OutOfRangeIsRefusedWithLine) {
  testing::TempDir dir("check-config");
  const std::string file =
      Write(dir, "bad.toml", "[[vm]]\nname = \"a\"\nweight = 0\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(file + ":3"), std::string::npos) << r.output;
}

TEST(CheckConfigTest, SyntaxErrorNamesFileLineColumn) {
  testing::TempDir dir("check-config");
  const std::string file = Write(dir, "bad.toml", "[store]\nshards = = 3\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(file + ":2:"), std::string::npos) << r.output;
}

TEST(CheckConfigTest, UnknownKeyIsAnError) {
  testing::TempDir dir("check-config");
  const std::string file = Write(dir, "bad.toml", "[store]\nmemroy_cap = 1\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("memroy_cap"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(file), std::string::npos) << r.output;
}

TEST(CheckConfigTest, CrossFieldErrorNamesTheFile) {
  testing::TempDir dir("check-config");
  const std::string file =
      Write(dir, "bad.toml", "[[vm]]\nname = \"a\"\n[[vm]]\nname = \"a\"\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("tmemd: " + file + ": VM 'a' is configured twice"),
            std::string::npos)
      << r.output;
}

TEST(CheckConfigTest, MissingSocketGroupIsAnError) {
  testing::TempDir dir("check-config");
  const std::string file = Write(
      dir, "bad.toml", "[channels]\nsocket_group = \"no-such-group-tmemd\"\n");
  const Result r = CheckConfig(dir, file);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("no-such-group-tmemd"), std::string::npos)
      << r.output;
}

TEST(CheckConfigTest, MissingFileIsAnError) {
  testing::TempDir dir("check-config");
  const Result r = CheckConfig(dir, dir.path() + "/absent.toml");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("absent.toml"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tmem
