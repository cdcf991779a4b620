// SocketGroup: the group tmemd gives its VM sockets, so that QEMU running
// as an unprivileged user can connect to them (mode 0660), and whether
// members of that group can reach the socket directory at all.
//
// On Debian, libvirt runs QEMU as user `libvirt-qemu`, group `libvirt-qemu`
// (qemu.conf's defaults), with the user's supplementary groups (`kvm`).
// tmemd does not rely on libvirt relabelling its sockets: it hands them to
// that group itself.
//
// Contract:
//  * ChooseSocketGroup(configured): a configured group (name or numeric
//    gid) must exist and be one tmemd may give files to (tmemd runs as
//    root, or the group is its effective or a supplementary group);
//    otherwise NOT_FOUND / FAILED_PRECONDITION with the reason and the fix,
//    never a silent fallback. With nothing configured: kDefaultSocketGroup
//    when that group exists and tmemd may use it; otherwise no group (the
//    sockets keep tmemd's own group) and `note` says why, for a warning.
//  * CheckGroupCanReach(dir, gid): every directory from / down to `dir`
//    must be searchable by a member of `gid` who is neither root nor the
//    owner (search permission for others, or for the group when the
//    directory's group is `gid`); FAILED_PRECONDITION naming the first one
//    that is not, with the command that fixes it.
// Thread-safe (getgrnam_r/getgrgid_r, no shared state).
#ifndef TMEMD_HOST_AGENT_CHANNEL_SOCKET_GROUP_H_
#define TMEMD_HOST_AGENT_CHANNEL_SOCKET_GROUP_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tmem {

// The group Debian's libvirt runs QEMU in (qemu.conf `group`).
inline constexpr std::string_view kDefaultSocketGroup = "libvirt-qemu";

struct SocketGroupChoice {
  std::optional<gid_t> gid;  // nullopt: leave the sockets' group alone
  std::string name;          // the group's name ("" when gid is nullopt)
  bool configured = false;   // named in the config (else the default)
  std::string note;          // why the default was not taken ("" if it was)
};

// A group name or numeric gid; NOT_FOUND when no such group exists.
absl::StatusOr<gid_t> ResolveGroup(const std::string& group);

absl::StatusOr<SocketGroupChoice> ChooseSocketGroup(
    const std::optional<std::string>& configured);

absl::Status CheckGroupCanReach(const std::string& dir, gid_t gid);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_SOCKET_GROUP_H_
