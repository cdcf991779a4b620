// Tests for host-agent/channel/socket_file.h over the real file system.
#include "host-agent/channel/socket_file.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

class SocketFileTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.empty()) << "mkdtemp failed"; }

  std::string MakeDir(const std::string& name, mode_t mode) {
    std::string d = dir_ + "/" + name;
    EXPECT_EQ(mkdir(d.c_str(), 0700), 0);
    EXPECT_EQ(chmod(d.c_str(), mode), 0);
    return d;
  }
  static int UnixSocket() {
    return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  }
  static bool Connects(const std::string& path) {
    const int fd = UnixSocket();
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const bool ok =
        connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    return ok;
  }
  static int Entries(const std::string& d) {
    int n = 0;
    for ([[maybe_unused]] const auto& e :
         std::filesystem::directory_iterator(d))
      ++n;
    return n;
  }

  tmem::testing::TempDir tmp_{"tmem-sockfile"};
  std::string dir_ = tmp_.path();
};

TEST_F(SocketFileTest, DirectoryWritableByOthersIsRefusedWithTheFix) {
  EXPECT_TRUE(CheckSocketDirectory(MakeDir("own", 0755)).ok());
  EXPECT_TRUE(CheckSocketDirectory(MakeDir("private", 0700)).ok());
  for (mode_t mode : {0777, 0770, 0757, 01777}) {
    const std::string d = MakeDir(absl::StrCat("w", mode), mode);
    const absl::Status s = CheckSocketDirectory(d);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << mode;
    EXPECT_NE(s.message().find("chmod go-w " + d), std::string::npos) << s;
  }
}

TEST_F(SocketFileTest, SymlinkFileAndMissingDirectoriesAreRefused) {
  const std::string real = MakeDir("real", 0700);
  const std::string link = dir_ + "/link";
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  EXPECT_EQ(CheckSocketDirectory(link).code(),
            absl::StatusCode::kFailedPrecondition);
  const std::string file = dir_ + "/file";
  std::ofstream(file) << "x";
  EXPECT_EQ(CheckSocketDirectory(file).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(CheckSocketDirectory(dir_ + "/missing").ok());
}

TEST_F(SocketFileTest, DirectoryOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  const std::string d = MakeDir("theirs", 0755);
  ASSERT_EQ(chown(d.c_str(), 65534, 65534), 0);
  const absl::Status s = CheckSocketDirectory(d);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("owned by uid 65534"), std::string::npos) << s;
}

// Regression: the socket was renamed into place before listen(), so a
// client that saw the path (QEMU, tmem-scenario) could be refused.
TEST_F(SocketFileTest, PublishedPathAcceptsConnectionsAtOnce) {
  const std::string path = dir_ + "/at-once.sock";
  const int fd = UnixSocket();
  ASSERT_TRUE(BindUnixSocket(fd, path, {0600, {}, {}}).ok());
  const int client = UnixSocket();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0)
      << "errno " << errno;
  close(client);
  close(fd);
}

TEST_F(SocketFileTest, BoundSocketHasItsModeWhateverTheUmask) {
  const mode_t old = umask(0077);
  for (mode_t mode : {0600, 0660, 0666}) {
    const std::string path = absl::StrCat(dir_, "/s", mode, ".sock");
    const int fd = UnixSocket();
    ASSERT_TRUE(BindUnixSocket(fd, path, {mode, {}, {}}).ok());
    ASSERT_EQ(listen(fd, 1), 0);
    struct stat st {};
    ASSERT_EQ(lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, mode);
    EXPECT_TRUE(Connects(path))
        << "a renamed socket still reaches its listener";
    close(fd);
  }
  umask(old);
  EXPECT_EQ(Entries(dir_), 3) << "no private directory left behind";
}

TEST_F(SocketFileTest, PlantedSymlinkAtThePathIsRefusedAndItsTargetUntouched) {
  const std::string victim = dir_ + "/victim";
  std::ofstream(victim) << "secret";
  ASSERT_EQ(chmod(victim.c_str(), 0600), 0);
  const std::string path = dir_ + "/vm.sock";
  ASSERT_EQ(symlink(victim.c_str(), path.c_str()), 0);
  const int fd = UnixSocket();
  const absl::Status s = BindUnixSocket(fd, path, {0666, {}, {}});
  close(fd);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("symbolic link"), std::string::npos) << s;
  struct stat st {};
  ASSERT_EQ(stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  ASSERT_EQ(lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "what was there is left alone";
}

TEST_F(SocketFileTest, StaleSocketIsReplacedLiveOneIsNot) {
  const std::string path = dir_ + "/vm.sock";
  {
    const int fd = UnixSocket();
    ASSERT_TRUE(BindUnixSocket(fd, path, {0600, {}, {}}).ok());
    close(fd);  // never listened: stale
  }
  const int live = UnixSocket();
  ASSERT_TRUE(BindUnixSocket(live, path, {0600, {}, {}}).ok());
  ASSERT_EQ(listen(live, 1), 0);
  const int other = UnixSocket();
  EXPECT_EQ(BindUnixSocket(other, path, {0600, {}, {}}).code(),
            absl::StatusCode::kAlreadyExists);
  close(other);
  close(live);
}

TEST_F(SocketFileTest, SocketPathsFromOutsideMustLieInTheDirectory) {
  const std::string d = "/run/tmemd";
  EXPECT_TRUE(SocketPathInDirectory("/run/tmemd/abc.sock", d).ok());
  EXPECT_TRUE(SocketPathInDirectory("/run/tmemd/abc.sock", d + "/").ok());
  for (const char* bad :
       {"/etc/passwd", "/run/tmemd", "/run/tmemd/", "/run/tmemd/../x.sock",
        "/run/tmemd/sub/x.sock", "/run/tmemdx/a.sock", "/run/tmemd/..",
        "/run/tmemd/.", "relative.sock", ""}) {
    const absl::Status s = SocketPathInDirectory(bad, d);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("socket directory '/run/tmemd'"),
              std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace tmem
