// A temporary directory for one test, removed with everything in it when
// the object goes.
#ifndef TMEMD_TESTS_TEMP_DIR_H_
#define TMEMD_TESTS_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace tmem::testing {

class TempDir {
 public:
  // Creates <base>/<prefix>-XXXXXX; path() is empty if that failed.
  explicit TempDir(const std::string& prefix,
                   const std::string& base = "/tmp") {
    std::string tmpl = base + "/" + prefix + "-XXXXXX";
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_TEMP_DIR_H_
