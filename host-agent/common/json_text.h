// JsonEscaped: text as the inside of a JSON string, for the few places that
// write JSON by hand (tmemd's JSON log lines, tmem-guestsim's report)
// rather than through a JSON library.
//
// '"' and '\\' are escaped, '\n' as \n and every other control character
// below 0x20 as \u00XX; every other byte, UTF-8 included, is kept as it
// is. Pure functions; thread-safe.
#ifndef TMEMD_HOST_AGENT_COMMON_JSON_TEXT_H_
#define TMEMD_HOST_AGENT_COMMON_JSON_TEXT_H_

#include <string>
#include <string_view>

namespace tmem {

// Appends `s`, escaped, to `out` (no quotes around it).
void AppendJsonEscaped(std::string& out, std::string_view s);

// `s`, escaped (no quotes around it).
std::string JsonEscaped(std::string_view s);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_COMMON_JSON_TEXT_H_
