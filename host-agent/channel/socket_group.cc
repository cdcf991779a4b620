#include "host-agent/channel/socket_group.h"

#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

// The group's name, or the number when it has none.
std::string GroupName(gid_t gid) {
  struct group entry {};
  struct group* g = nullptr;
  std::vector<char> buf(16384);
  if (getgrgid_r(gid, &entry, buf.data(), buf.size(), &g) == 0 &&
      g != nullptr) {
    return g->gr_name;
  }
  return absl::StrCat(gid);
}

// Whether this process may chgrp a file it owns to `gid`.
bool MayUseGroup(gid_t gid) {
  if (geteuid() == 0 || getegid() == gid) return true;
  const int n = getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  const int got = getgroups(n, groups.data());
  for (int i = 0; i < got; ++i) {
    if (groups[static_cast<size_t>(i)] == gid) return true;
  }
  return false;
}

std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

}  // namespace

absl::StatusOr<gid_t> ResolveGroup(const std::string& group) {
  gid_t gid = 0;
  if (absl::SimpleAtoi(group, &gid)) return gid;
  struct group entry {};
  struct group* g = nullptr;
  std::vector<char> buf(16384);
  if (getgrnam_r(group.c_str(), &entry, buf.data(), buf.size(), &g) != 0 ||
      g == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("socket group '", group, "' does not exist on this host"));
  }
  return g->gr_gid;
}

absl::StatusOr<SocketGroupChoice> ChooseSocketGroup(
    const std::optional<std::string>& configured) {
  SocketGroupChoice out;
  if (configured.has_value()) {
    absl::StatusOr<gid_t> gid = ResolveGroup(*configured);
    if (!gid.ok()) return gid.status();
    if (!MayUseGroup(*gid)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "socket group '", *configured, "' (gid ", *gid,
          ") is not one tmemd (uid ", geteuid(),
          ") belongs to, so it cannot give its sockets to it: add tmemd's "
          "user to the group (adduser tmemd ",
          GroupName(*gid),
          ") or set [channels] socket_group to a group it "
          "is in"));
    }
    out.gid = *gid;
    out.name = GroupName(*gid);
    out.configured = true;
    return out;
  }
  const std::string def(kDefaultSocketGroup);
  absl::StatusOr<gid_t> gid = ResolveGroup(def);
  if (!gid.ok()) {
    out.note = absl::StrCat(
        "group '", def,
        "' (the group libvirt runs QEMU in on Debian) does not exist here; "
        "sockets keep tmemd's own group: set [channels] socket_group to the "
        "group QEMU runs in");
    return out;
  }
  if (!MayUseGroup(*gid)) {
    out.note = absl::StrCat(
        "tmemd (uid ", geteuid(), ") is not in group '", def,
        "', the group libvirt runs QEMU in, so QEMU running as libvirt-qemu "
        "cannot connect; sockets keep tmemd's own group: run 'adduser "
        "tmemd ",
        def, "' and restart tmemd, or set [channels] socket_group");
    return out;
  }
  out.gid = *gid;
  out.name = def;
  return out;
}

absl::Status CheckGroupCanReach(const std::string& dir, gid_t gid) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("socket directory '", dir, "' is not an absolute path"));
  }
  // "/", "/run", "/run/tmemd": each must let the group search it.
  std::vector<std::string> chain = {"/"};
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos == dir.size() || dir[pos] == '/') {
      if (pos > 1 && dir[pos - 1] != '/') chain.push_back(dir.substr(0, pos));
    }
  }
  for (const std::string& d : chain) {
    struct stat st {};
    if (stat(d.c_str(), &st) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot inspect '", d,
                                                     "' on the way to the "
                                                     "socket directory"));
    }
    const bool others = (st.st_mode & S_IXOTH) != 0;
    const bool group = st.st_gid == gid && (st.st_mode & S_IXGRP) != 0;
    if (!others && !group) {
      const std::string name = GroupName(gid);
      return absl::FailedPreconditionError(absl::StrCat(
          "'", d, "' (mode ", Octal(st.st_mode), ", group ",
          GroupName(st.st_gid), ") cannot be searched by group '", name,
          "', so QEMU running in that group cannot reach the sockets in '", dir,
          "': run 'chgrp ", name, " ", d, " && chmod g+x ", d,
          "' (or 'chmod o+x ", d, "'), or use another socket_dir"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tmem
